"""Code that runs in a sandbox and turns its guest hostile, for the hostile-guest tests.

User code runs as root in the guest, so it can do what a compromised guest could: freeze the
agent (SIGSTOP) and take over the agent's end of the virtio channel (``pidfd_getfd``), then send
the host anything, read what the host sends, or read nothing at all. ``impostor(...)`` builds
such a cell: after its prelude the names ``send(message)``, ``send_raw(data)``, ``frames()``
(the host's frames, decoded, as they come) and ``parent`` (the header of the running execute
request) are defined.
"""

from __future__ import annotations

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
parent = dict(get_ipython().parent_header)

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

def jupyter(channel, msg_type, content, metadata=None):
    send({'op': 'jupyter', 'channel': channel, 'msg': {
        'header': {'msg_id': os.urandom(8).hex(), 'msg_type': msg_type, 'session': 'x',
                   'username': 'x', 'date': '2026-01-01T00:00:00Z', 'version': '5.3'},
        'parent_header': parent, 'metadata': metadata or {}, 'content': content,
        'buffers': []}})

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
