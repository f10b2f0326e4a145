"""Code that runs in a sandbox and turns its guest hostile, for the hostile-guest tests.

User code runs as root in the guest, so it can do what a compromised guest could: freeze the
agent (SIGSTOP) and take over the agent's end of the virtio channel (``pidfd_getfd``), then send
the host anything, read what the host sends, or read nothing at all. ``impostor(...)`` builds
such a cell: after its prelude the names ``send(message)``, ``send_raw(data)``, ``frames()``
(the host's frames, decoded, as they come) and ``parent`` (the header of the running execute
request) are defined.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

PRELUDE = r"""
import ctypes, glob, os, signal, struct, threading
import msgpack

def _agent_pid():
    for p in glob.glob('/proc/[0-9]*/cmdline'):
        try:
            argv = open(p, 'rb').read().split(b'\0')
        except OSError:
            continue
        if argv[0].endswith(b'python3') and b'kernelhost_agent' in argv:
            return int(p.split('/')[2])

_pid = _agent_pid()
_port = next(int(n) for n in os.listdir(f'/proc/{_pid}/fd')
             if os.readlink(f'/proc/{_pid}/fd/{n}').startswith('/dev/vport'))
os.kill(_pid, signal.SIGSTOP)
fd = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(_pid), _port, 0)
assert fd >= 0, ctypes.get_errno()
# the running execute request's header (its date is a datetime in the kernel: made a string)
_request = get_ipython().parent_header['header']  # the kernel keeps the whole parent message
parent = {k: v.isoformat() if hasattr(v, 'isoformat') else v for k, v in _request.items()}

def frame(message):
    body = msgpack.packb(message, use_bin_type=True)
    return struct.pack('>I', len(body)) + body

def send_raw(data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

def send(message):
    send_raw(frame(message))

def frames():
    buf = b''
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            continue
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack('>I', buf[:4])[0]:
            n = struct.unpack('>I', buf[:4])[0]
            yield msgpack.unpackb(buf[4:4 + n], raw=False, strict_map_key=False)
            buf = buf[4 + n:]

def message(channel, msg_type, content, metadata=None):
    return {'op': 'jupyter', 'channel': channel, 'msg': {
        'header': {'msg_id': os.urandom(8).hex(), 'msg_type': msg_type, 'session': 'x',
                   'username': 'x', 'date': '2026-01-01T00:00:00Z', 'version': '5.3'},
        'parent_header': parent, 'metadata': metadata or {}, 'content': content,
        'buffers': []}}

def jupyter(channel, msg_type, content, metadata=None):
    send(message(channel, msg_type, content, metadata))

def finish():
    '''End the running execute as the kernel would (the agent is frozen: nobody else will).'''
    jupyter('iopub', 'status', {'execution_state': 'idle'})
    jupyter('shell', 'execute_reply', {'status': 'ok', 'execution_count': 1})
"""

# Freeze the agent and nothing else: the guest stops reading its channel.
FREEZE = r"""
import glob, os, signal
for p in glob.glob('/proc/[0-9]*/cmdline'):
    try:
        argv = open(p, 'rb').read().split(b'\0')
    except OSError:
        continue
    if argv[0].endswith(b'python3') and b'kernelhost_agent' in argv:
        os.kill(int(p.split('/')[2]), signal.SIGSTOP)
"""


def impostor(body: str) -> str:
    """A cell that takes over the channel, then runs ``body`` (which uses the prelude's names)."""
    return PRELUDE + "\n" + body


# -- attacks and a benign workload, in loops (the soak test and bench/bench_hostile.py) ---------

#: the bodies of impostor cells, one per kind of attack; each gets the guest cut off
ATTACKS = {
    # frames for tunnels that do not exist
    "stray_tunnels": "send_raw(b''.join(frame({'op': 'net', 't': 'data', 'tunnel': i + 1, 'data': b''})"
    " for i in range(20000)))\nimport time\ntime.sleep(60)",
    # a frame of millions of empty maps
    "object_bomb": "inner = b'\\xdd' + (500000).to_bytes(4, 'big') + b'\\x80' * 500000\n"
    "payload = b'\\x81' + msgpack.packb('op') + b'\\xdc' + (8).to_bytes(2, 'big') + inner * 8\n"
    "send_raw(len(payload).to_bytes(4, 'big') + payload)\nimport time\ntime.sleep(60)",
    # the host's log
    "log_flood": "for i in range(2000):\n    send({'op': 'event', 'event': 'e' * 4096})\n"
    "send({'op': 'x' * (1 << 20)})\nimport time\ntime.sleep(60)",
}


@dataclass
class Tally:
    """What the loops saw: attack outcomes, how long each DELETE took, benign latencies."""

    attacks: dict[str, int] = field(default_factory=dict)
    deletes: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    service_cpu_s: float = 0.0  # the service's own CPU time over a phase (bench_hostile)


async def hostile_loop(url: str, key: str, kind: str, stop: asyncio.Event, tally: Tally) -> None:
    """Create a sandbox, turn its guest hostile (``kind``: an ATTACKS name, or ``freeze``:
    stop reading, then DELETE it), until ``stop`` is set."""
    from kernelhost import AsyncSandbox
    from kernelhost.client import KernelHostError, NotFoundError

    while not stop.is_set():
        sbx = await AsyncSandbox.create(url=url, api_key=key)
        try:
            if kind == "freeze":
                await _freeze_and_delete(sbx, tally)
            else:
                ended = await asyncio.wait_for(sbx.run_code(impostor(ATTACKS[kind]), timeout=120), 180)
                outcome = ended.error.name if ended.error else str(ended.status)
                tally.attacks[outcome] = tally.attacks.get(outcome, 0) + 1
        except (KernelHostError, TimeoutError) as exc:
            tally.errors.append(f"{kind}: {type(exc).__name__}: {exc}"[:300])
        finally:
            with contextlib.suppress(NotFoundError):
                await sbx.close()


async def _freeze_and_delete(sbx: Any, tally: Tally) -> None:
    frozen = asyncio.ensure_future(sbx.run_code(FREEZE + "\nimport time\ntime.sleep(3600)"))
    await asyncio.sleep(2)
    upload = asyncio.ensure_future(sbx.files.write("big.bin", b"\0" * (6 << 20)))
    await asyncio.sleep(2)
    t0 = time.monotonic()
    await asyncio.wait_for(sbx.close(), 60)
    tally.deletes.append(time.monotonic() - t0)
    await asyncio.wait({frozen, upload}, timeout=60)
    for task in (frozen, upload):
        if not task.done():
            task.cancel()
            tally.errors.append("a call on a deleted, frozen sandbox did not end")
        elif not task.cancelled():
            task.exception()  # retrieved: an error is what a call on a deleted sandbox gets


async def benign_loop(sbx: Any, stop: asyncio.Event, tally: Tally, pause: float = 0.5) -> None:
    """A fixed workload: a small computation, then a pause, until ``stop`` is set."""
    while not stop.is_set():
        t0 = time.perf_counter()
        ran = await sbx.run_code("sum(i * i for i in range(20000))", timeout=120)
        tally.latencies.append(time.perf_counter() - t0)
        if ran.text != "2666466670000":
            tally.errors.append(f"benign call answered {ran.text!r} ({ran.status})")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause)
