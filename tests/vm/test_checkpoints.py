"""Checkpoints through real VMs: restore in place, branch, undo, a service restart and a
hibernation in between, another key's view, the byte budget, a kept checkpoint outliving its
sandbox."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox, ExecutionStatus, InvalidRequestError, NotFoundError, RateLimitError

from ..harness import Service

pytestmark = pytest.mark.vm

STATE = (
    "import os, random\n"
    "answer = 41\n"
    "open('/tmp/notes.txt', 'w').write('kept')\n"
    "blob = os.urandom(8 << 20)\n"
    "answer"
)


def _files(service: Service, sandbox_id: str) -> list[Path]:
    return sorted((service.state_dir / "checkpoints" / sandbox_id).glob("*"))


async def test_restore_rewinds_variables_files_and_the_shell_in_the_same_sandbox(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    try:
        assert (await sbx.run_code(STATE)).text == "41"
        await sbx.run_code("mkdir -p /tmp/work && cd /tmp/work && export STAGE=one", language="bash")
        cp = await sbx.checkpoint(label="before the damage")
        assert cp.label == "before the damage" and cp.sandbox_id == sbx.id
        assert 1 << 20 < cp.bytes < 64 << 20  # the state it added, not the VM's 512 MiB
        assert [c.id for c in await sbx.checkpoints()] == [cp.id]
        assert [p.name for p in _files(service, sbx.id)] == [f"{cp.id}.zst"]

        damage = await sbx.run_code("answer = 0\nos.remove('/tmp/notes.txt')\ndel blob\nanswer")
        assert damage.text == "0"
        await sbx.run_code("cd / && export STAGE=two", language="bash")

        assert (await sbx.restore(cp)).id == cp.id
        back = await sbx.run_code("answer, open('/tmp/notes.txt').read(), len(blob)")
        assert back.text == f"(41, 'kept', {8 << 20})"
        shell = await sbx.run_code("pwd; echo $STAGE", language="bash")
        assert shell.stdout == "/tmp/work\none\n"
        info = await sbx.info()
        assert info.id == sbx.id and info.state == "running"

        # the clock is current and the random streams are fresh after every restore
        first = (await sbx.run_code("import time; (random.random(), round(time.time()))")).text
        await sbx.restore(cp)
        second = (await sbx.run_code("import time; (random.random(), round(time.time()))")).text
        assert first != second
    finally:
        await sbx.close()
    assert _files(service, sbx.id) == []  # deleting the sandbox deletes its checkpoints


async def test_a_branch_and_its_origin_diverge_and_the_branch_outlives_its_checkpoint(
    service: Service,
) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key, metadata={"who": "origin"})
    branch = None
    try:
        await sbx.run_code("path = ['origin']")
        cp = await sbx.checkpoint()
        branch = await AsyncSandbox.create(url=service.url, api_key=service.api_key, checkpoint=cp)
        assert branch.id != sbx.id
        info = await branch.info()
        assert info.metadata.get("branched_from") == cp.id and info.template == "python"
        await branch.run_code("path.append('branch')")
        await sbx.run_code("path.append('origin again')")
        assert (await branch.run_code("path")).text == "['origin', 'branch']"
        assert (await sbx.run_code("path")).text == "['origin', 'origin again']"
        await sbx.delete_checkpoint(cp)
        assert await sbx.checkpoints() == []
        assert (await branch.run_code("len(path)")).text == "2"  # runs from its own VM
        with pytest.raises(NotFoundError):
            await sbx.restore(cp)
    finally:
        await sbx.close()
        if branch is not None:
            await branch.close()


async def test_undo_gives_back_the_dataframe_a_cell_overwrote(service: Service) -> None:
    sbx = await AsyncSandbox.create(
        template="python-datasci", url=service.url, api_key=service.api_key, auto_checkpoint=3
    )
    try:
        made = await sbx.run_code("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2, 3]})\nint(df.a.sum())")
        assert made.text == "6"
        assert (await sbx.run_code("df['a'] = 0\nint(df.a.sum())")).text == "0"
        back = await sbx.undo()
        assert back.auto and back.before_call == 2
        assert (await sbx.run_code("int(df.a.sum())")).text == "6"
        await sbx.run_code("df = None")
        await sbx.run_code("x = 1")
        await sbx.undo(2)  # back before "df = None"
        assert (await sbx.run_code("int(df.a.sum())")).text == "6"
        autos = [c for c in await sbx.checkpoints() if c.auto]
        assert 1 <= len(autos) <= 4  # keep (3) + the state before the next call
        with pytest.raises(InvalidRequestError, match="out of range"):
            await sbx.undo(9)
    finally:
        await sbx.close()


async def test_a_call_running_during_a_restore_ends_with_status_restored(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    try:
        await sbx.run_code("mark = 'then'")
        cp = await sbx.checkpoint()
        slow = asyncio.create_task(sbx.run_code("import time\nmark = 'now'\ntime.sleep(60)"))
        await asyncio.sleep(1.0)
        await sbx.restore(cp)
        ended = await asyncio.wait_for(slow, 30)
        assert ended.status == ExecutionStatus.RESTORED
        assert ended.error is not None and cp.id in ended.error.value
        assert (await sbx.run_code("mark")).text == "'then'"
    finally:
        await sbx.close()


async def test_checkpoints_survive_a_hibernation_and_a_service_restart(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    try:
        await sbx.run_code("stage = 'awake'")
        awake = await sbx.checkpoint(label="awake")
        await sbx.run_code("stage = 'asleep'")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
            r = await http.post(f"{service.url}/v1/sandboxes/{sbx.id}/hibernate")
            assert (await r.json())["state"] == "hibernated"
        asleep = await sbx.checkpoint(label="asleep")  # from the saved state, without a wake
        assert (await sbx.info()).state == "hibernated"
        woken = await asyncio.wait_for(sbx.run_code("stage"), 60)  # the VM is free to wake
        assert woken.text == "'asleep'"
        service.stop()
        service.start()
        again = await AsyncSandbox.connect(sbx.id, url=service.url, api_key=service.api_key)
        try:
            assert [c.label for c in await again.checkpoints()] == ["awake", "asleep"]
            await again.restore(awake)
            assert (await again.run_code("stage")).text == "'awake'"
            await again.restore(asleep)
            assert (await again.run_code("stage")).text == "'asleep'"
        finally:
            await again.close()
    finally:
        await sbx.close()


async def test_another_keys_checkpoints_are_404_on_every_route(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    try:
        cp = await sbx.checkpoint()
        base = f"{service.url}/v1/sandboxes/{sbx.id}"
        calls = [
            ("POST", f"{base}/checkpoints", {}),
            ("GET", f"{base}/checkpoints", None),
            ("GET", f"{base}/checkpoints/{cp.id}", None),
            ("DELETE", f"{base}/checkpoints/{cp.id}", None),
            ("POST", f"{base}/restore", {"checkpoint": cp.id}),
            ("POST", f"{base}/undo", {"n": 1}),
            ("POST", f"{service.url}/v1/sandboxes", {"checkpoint": cp.id}),
        ]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.other_key}"}) as http:
            for method, url, body in calls:
                r = await http.request(method, url, json=body)
                assert r.status == 404, (method, url, r.status, await r.text())
        assert [c.id for c in await sbx.checkpoints()] == [cp.id]  # nothing was touched
        other = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
        try:
            with pytest.raises(InvalidRequestError, match="start a new sandbox from it"):
                await other.restore(cp)  # the key's own checkpoint, of another of its sandboxes
        finally:
            await other.close()
    finally:
        await sbx.close()


async def test_the_byte_budget_answers_429_and_nothing_is_lost(tmp_path: Path) -> None:
    budget = str(40 << 20)
    svc = Service.make(tmp_path, KERNELHOST_MAX_CHECKPOINT_BYTES_PER_KEY=budget, KERNELHOST_POOL_SIZE="1")
    svc.start()
    try:
        sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        await sbx.run_code("small = 'state'")
        kept = await sbx.checkpoint()
        await sbx.run_code("import os\nbig = os.urandom(48 << 20)")
        with pytest.raises(RateLimitError) as err:
            await sbx.checkpoint()
        assert err.value.status == 429 and "max_checkpoint_bytes_per_key" in str(err.value)
        assert [c.id for c in await sbx.checkpoints()] == [kept.id]
        assert [p.name for p in _files(svc, sbx.id)] == [f"{kept.id}.zst"]  # no half-written file
        assert (await sbx.run_code("len(big)")).text == str(48 << 20)  # the sandbox runs on
        await sbx.restore(kept)
        assert (await sbx.run_code("small, 'big' in globals()")).text == "('state', False)"
        await sbx.close()
    finally:
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs


USERFAULTFD = Path("/proc/sys/vm/unprivileged_userfaultfd")


async def test_a_live_checkpoint_holds_the_moment_it_was_taken(tmp_path: Path) -> None:
    """live_checkpoints = on: QEMU's background snapshot (the host must let QEMU use
    userfaultfd, which this test allows for its duration); the VM runs on while it is written."""
    before = USERFAULTFD.read_text().strip()
    USERFAULTFD.write_text("1\n")
    svc = Service.make(tmp_path, KERNELHOST_LIVE_CHECKPOINTS="on", KERNELHOST_POOL_SIZE="1")
    try:
        svc.start()
        sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        await sbx.run_code(STATE)
        taking = asyncio.create_task(sbx.checkpoint())
        await asyncio.sleep(0.3)  # the VM is already running again: this call changes it
        assert (await sbx.run_code("answer = 7\nanswer")).text == "7"
        cp = await taking
        await sbx.restore(cp)
        back = await sbx.run_code("answer, open('/tmp/notes.txt').read(), len(blob)")
        assert back.text in (f"(41, 'kept', {8 << 20})", f"(7, 'kept', {8 << 20})")
        await sbx.close()
        stored = svc.log_events("checkpoint.stored")
        assert stored and all(e.get("live") is True for e in stored), stored
    finally:
        USERFAULTFD.write_text(before + "\n")
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs


async def test_a_kept_checkpoint_outlives_its_sandbox_and_a_restart_and_branches(service: Service) -> None:
    """E2B's snapshots are kept checkpoints (the E2B surface takes them): deleting the sandbox
    and the clean-up at start leave them, prune keeps their build, a branch gets their network."""
    from kernelhost.sandboxes.vm.prune import BY_CHECKPOINT, referenced_builds

    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key, network="outbound")
    async with aiohttp.ClientSession(headers={"X-API-KEY": service.api_key}) as http:
        try:
            await sbx.run_code("origin = 'kept'")
            r = await http.post(f"{service.url}/e2b/sandboxes/{sbx.id}/snapshots", json={})
            assert r.status == 201, await r.text()
            cid = (await r.json())["snapshotID"]
            dropped = await sbx.checkpoint()  # not kept: goes with the sandbox
            assert {c.id for c in await sbx.checkpoints()} == {cid, dropped.id}
        finally:
            await sbx.close()
        assert [p.name for p in _files(service, sbx.id)] == [f"{cid}.zst"]
        service.stop()
        service.start()
        assert [p.name for p in _files(service, sbx.id)] == [f"{cid}.zst"]
        refs = referenced_builds(service.state_dir / "kernelhost.sqlite3")
        assert [r.template for r in refs if r.why == BY_CHECKPOINT] == ["python"]
        branch = await AsyncSandbox.create(url=service.url, api_key=service.api_key, checkpoint=cid)
        try:
            assert (await branch.run_code("origin")).text == "'kept'"
            info = await branch.info()
            assert info.network["mode"] == "outbound" and info.metadata["branched_from"] == cid
        finally:
            await branch.close()
        r = await http.delete(f"{service.url}/e2b/templates/{cid}")
        assert r.status == 204
    assert _files(service, sbx.id) == []
