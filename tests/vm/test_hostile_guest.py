"""A hostile guest against the host, through real VMs: the guest's own code freezes its agent and
speaks for it on the channel (``hostile.py``). Whatever it sends, or does not read, the host
must stay bounded in memory, tasks and log lines, answer every other call on time, and either
cut the guest off (destroying its VM) or carry on.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import KernelHostError, NotFoundError

from ..harness import Service
from .hostile import FREEZE, impostor

pytestmark = pytest.mark.vm


def rss_mib(service: Service) -> float:
    assert service.proc is not None
    with open(f"/proc/{service.proc.pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture
async def victim(client_env: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(template="python")
    try:
        yield sbx
    finally:
        try:
            await asyncio.wait_for(sbx.close(), 30)
        except NotFoundError:
            pass  # the service removed it: a guest that broke the protocol is not kept


async def _gone(service: Service, sandbox_id: str, timeout: float = 30) -> None:
    """Wait until no domain of the service is labelled with ``sandbox_id``."""
    hv = service.hypervisor()
    try:
        deadline = time.monotonic() + timeout
        while [d for d in hv.domains() if d.metadata.get("sandbox") == sandbox_id]:
            assert time.monotonic() < deadline, f"the VM of {sandbox_id} outlived its sandbox"
            await asyncio.sleep(0.2)
    finally:
        hv.close()


async def _cut_off(service: Service, victim: AsyncSandbox, body: str) -> Any:
    """Run an impostor ``body``: the guest must be cut off and its VM destroyed."""
    ended = await asyncio.wait_for(victim.run_code(impostor(body), timeout=120), 180)
    assert ended.error is not None and ended.error.name == "SandboxLost", (ended.status, ended.error)
    with pytest.raises(NotFoundError):
        await victim.info()
    await _gone(service, victim.id)
    return ended


# -- a guest that stops reading ------------------------------------------------------


async def test_a_guest_that_stops_reading_holds_neither_a_delete_nor_the_reaper(
    service: Service, client_env: Service, victim: AsyncSandbox
) -> None:
    idle = await AsyncSandbox.create(idle_timeout_seconds=3, api_key=service.other_key)
    try:
        frozen = asyncio.ensure_future(victim.run_code(FREEZE + "\nimport time\ntime.sleep(3600)"))
        await asyncio.sleep(3)  # the agent is stopped: nothing reads the guest's end
        # more than the virtqueue and the socket buffer hold: the host's writes back up
        upload = asyncio.ensure_future(victim.files.write("big.bin", os.urandom(8 << 20)))
        await asyncio.sleep(3)
        t0 = time.monotonic()
        await asyncio.wait_for(victim.close(), 30)
        assert time.monotonic() - t0 < 15, "DELETE waited on the guest"
        await _gone(service, victim.id)
        done, pending = await asyncio.wait({frozen, upload}, timeout=60)
        assert not pending, "a call on the deleted sandbox still hangs"
        for task in done:
            assert task.exception() is None or isinstance(task.exception(), KernelHostError)
        deadline = time.monotonic() + 30  # the reaper went on with everyone else's sandboxes
        while (await idle.info()).state != "hibernated":
            assert time.monotonic() < deadline, "the reaper stopped hibernating idle sandboxes"
            await asyncio.sleep(0.5)
    finally:
        await idle.close()


async def test_the_timeout_ladder_fires_past_a_send_the_guest_never_takes(victim: AsyncSandbox) -> None:
    cell = asyncio.ensure_future(victim.run_code(FREEZE + "\nimport time\ntime.sleep(3600)", timeout=8))
    await asyncio.sleep(3)
    upload = asyncio.ensure_future(victim.files.write("big.bin", os.urandom(8 << 20)))
    ended = await asyncio.wait_for(cell, 150)
    assert ended.status == "timeout" and ended.recovery == "vm_replaced", (ended.status, ended.recovery)
    await asyncio.wait({upload}, timeout=60)
    assert upload.done()
    assert (await victim.run_code("1 + 1", timeout=120)).text == "2"  # a fresh VM answers


# -- findings 2, 3: what a frame may cost the host ------------------------------------------------


async def test_frames_for_tunnels_that_do_not_exist_cut_the_guest_off(
    service: Service, victim: AsyncSandbox, sandbox: AsyncSandbox
) -> None:
    before = rss_mib(service)
    await _cut_off(
        service,
        victim,
        "send_raw(b''.join(frame({'op': 'net', 't': 'data', 'tunnel': i + 1, 'data': b''})"
        " for i in range(50000)))\nimport time\ntime.sleep(60)",
    )
    assert rss_mib(service) - before < 64, "stray tunnel frames grew the service's memory"
    assert (await sandbox.run_code("1 + 1", timeout=60)).text == "2"


async def test_a_frame_that_decodes_to_millions_of_objects_is_refused(
    service: Service, victim: AsyncSandbox, sandbox: AsyncSandbox
) -> None:
    before = rss_mib(service)
    # 16 arrays of 500,000 empty maps: 8 MiB on the wire, some 600 MiB once decoded
    body = (
        "import msgpack\n"
        "inner = b'\\xdd' + (500000).to_bytes(4, 'big') + b'\\x80' * 500000\n"
        "payload = b'\\x83' + msgpack.packb('op') + msgpack.packb('event') + msgpack.packb('event') "
        "+ msgpack.packb('x') + msgpack.packb('pad') + b'\\xdc' + (16).to_bytes(2, 'big') + inner * 16\n"
        "send_raw(len(payload).to_bytes(4, 'big') + payload)\nimport time\ntime.sleep(60)"
    )
    await _cut_off(service, victim, body)
    assert rss_mib(service) - before < 150, "one frame's decoding grew the service's memory"
    assert (await sandbox.run_code("1 + 1", timeout=60)).text == "2"


async def test_a_reply_nobody_asked_for_cuts_the_guest_off(service: Service, victim: AsyncSandbox) -> None:
    await _cut_off(
        service, victim, "send({'op': 'reply', 'id': 10**9, 'ok': True})\nimport time\ntime.sleep(60)"
    )


# -- the host's logs ----------------------------------------------------------------------


async def test_a_guest_cannot_flood_the_hosts_log(service: Service, victim: AsyncSandbox) -> None:
    log_before = service.log_path.stat().st_size
    body = (
        "for i in range(5000):\n"
        "    send({'op': 'event', 'event': 'e' * 4096})\n"
        "send({'op': 'x' * (4 << 20)})  # an op of 4 MiB: unknown, a violation\n"
        "import time\ntime.sleep(60)"
    )
    ended = await _cut_off(service, victim, body)
    assert len(ended.error.value) < 2000, "the guest's text went into the caller's error in full"
    grown = service.log_path.stat().st_size - log_before
    assert grown < 256 * 1024, f"the guest wrote {grown} bytes into the service's log"


# -- values that are not JSON -----------------------------------------------------------


def _strict(line: bytes) -> dict[str, Any]:
    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    event = json.loads(line, parse_constant=refuse)
    assert isinstance(event, dict)
    return event


async def test_guest_values_that_are_not_json_never_cut_the_stream(
    service: Service, victim: AsyncSandbox
) -> None:
    # NaN and infinity, and nesting deeper than JSON encoders recurse (msgpack's own packer stops
    # at 511 levels: the deep value is spliced in as raw bytes)
    body = (
        "m = message('iopub', 'display_data', {'data': {'text/plain': 'shown', 'application/json': "
        "{'x': float('nan')}, 'application/vnd.deep+json': '@@DEEP@@'}, 'metadata': {'m': float('inf')}})\n"
        "deep = b'\\x91' * 900 + b'\\xc0'\n"
        "raw = msgpack.packb(m, use_bin_type=True).replace(msgpack.packb('@@DEEP@@'), deep)\n"
        "send_raw(len(raw).to_bytes(4, 'big') + raw)\n"
        "jupyter('iopub', 'stream', {'name': 'stdout', 'text': 'after\\n'})\n"
        "finish()"
    )
    headers = {"Authorization": f"Bearer {service.api_key}"}
    async with (
        aiohttp.ClientSession(headers=headers) as http,
        http.post(
            f"{service.url}/v1/sandboxes/{victim.id}/execute", json={"code": impostor(body), "timeout": 60}
        ) as r,
    ):
        assert r.status == 200
        raw = await asyncio.wait_for(r.read(), 120)
    events = [_strict(line) for line in raw.splitlines() if line.strip()]
    assert events[-1]["type"] == "end", events[-1]
    results = [e for e in events if e["type"] == "result"]
    assert len(results) == 1, events
    [result] = results
    assert result["data"]["text/plain"].startswith("shown") and result["truncated"] is True
    assert "application/json" not in result["data"] and result["metadata"] == {}
    assert any(e["type"] == "stdout" and e["text"] == "after\n" for e in events)


async def test_a_listing_the_guest_garbles_is_an_empty_listing_not_a_500(
    service: Service, victim: AsyncSandbox
) -> None:
    body = (
        "def answer():\n"
        "    for f in frames():\n"
        "        if f.get('op') == 'fs_list':\n"
        "            send({'op': 'reply', 'id': f['id'], 'ok': True, 'path': '/home/user', 'entries': 5})\n"
        "threading.Thread(target=answer, daemon=True).start()\n"
        "finish()"
    )
    ended = await asyncio.wait_for(victim.run_code(impostor(body), timeout=60), 120)
    assert ended.status == "ok", (ended.status, ended.error)
    listing = await asyncio.wait_for(victim.files.list("."), 30)
    assert listing == []


# -- raw bash output (bash_out frames) -------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        "{'op': 'bash_out', 'run_id': 5, 'name': 'stdout', 'data': b'x'}",
        "{'op': 'bash_out', 'run_id': 'r', 'name': 'stdin', 'data': b'x'}",
        "{'op': 'bash_out', 'run_id': 'r', 'name': 'stdout', 'data': 'text'}",
        "{'op': 'bash_out', 'run_id': 'r', 'name': 'stdout', 'data': b'x' * (3 << 20)}",  # oversize
    ],
    ids=["run_id", "name", "data", "oversize"],
)
async def test_bash_output_of_the_wrong_shape_cuts_the_guest_off(
    service: Service, victim: AsyncSandbox, frame: str
) -> None:
    await _cut_off(service, victim, f"send({frame})\nimport time\ntime.sleep(60)")


async def test_bash_output_of_runs_the_host_never_started_reaches_nobody(
    service: Service, victim: AsyncSandbox
) -> None:
    # raw output claiming the running cell (a Python execute) and a made-up run: dropped, and the
    # guest is not cut off for it (a fork's children carry on their parent's commands honestly)
    body = (
        "send({'op': 'bash_out', 'run_id': parent['msg_id'], 'name': 'stdout', 'data': b'injected'})\n"
        "send({'op': 'bash_out', 'run_id': 'made-up', 'name': 'stderr', 'data': b'x' * (2 << 20)})\n"
        "jupyter('iopub', 'stream', {'name': 'stdout', 'text': 'after\\n'})\n"
        "finish()"
    )
    ended = await asyncio.wait_for(victim.run_code(impostor(body), timeout=60), 120)
    assert ended.status == "ok" and ended.error is None, (ended.status, ended.error)
    assert ended.stdout == "after\n" and ended.stderr == ""
    await victim.info()  # still there
