"""Template snapshots, warm pool, fork, hibernate/wake and clone hygiene, through real VMs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import pytest

from kernelhost import AsyncSandbox

from ..harness import Service

pytestmark = pytest.mark.vm

T = TypeVar("T")

RANDOMS = (
    "import json, os, random, uuid\n"
    "print(json.dumps([random.random(), os.urandom(16).hex(), str(uuid.uuid4())]))"
)


async def _randoms(sbx: AsyncSandbox) -> list[object]:
    execution = await sbx.run_code(RANDOMS)
    assert execution.error is None, execution.error
    return list(json.loads(execution.stdout))


async def _state(service: Service, sandbox_id: str) -> str:
    async with aiohttp.ClientSession() as http:
        r = await http.get(
            f"{service.url}/v1/sandboxes/{sandbox_id}", headers={"Authorization": f"Bearer {service.api_key}"}
        )
        return str((await r.json())["state"])


async def _wait_state(service: Service, sandbox_id: str, want: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while (state := await _state(service, sandbox_id)) != want:
        assert time.monotonic() < deadline, f"{sandbox_id} still {state!r}, wanted {want!r}"
        await asyncio.sleep(0.25)


async def test_fork_children_hold_parent_state_and_diverge(sandbox: AsyncSandbox) -> None:
    setup = await sandbox.run_code(
        "import collections\n"
        "data = list(range(100_000))\n"
        "tally = collections.Counter(a=1)\n"
        "open('/tmp/shared.txt', 'w').write('from parent')"
    )
    assert setup.error is None
    kids = await sandbox.fork(2)
    try:
        assert len(kids) == 2 and len({k.id for k in kids} | {sandbox.id}) == 3
        for kid in kids:
            seen = await kid.run_code("(len(data), tally['a'], open('/tmp/shared.txt').read())")
            assert seen.text == "(100000, 1, 'from parent')"
        await kids[0].run_code("tally['a'] = 99\nopen('/tmp/shared.txt', 'w').write('child 0')")
        assert (
            await kids[1].run_code("tally['a'], open('/tmp/shared.txt').read()")
        ).text == "(1, 'from parent')"
        assert (
            await sandbox.run_code("tally['a'], open('/tmp/shared.txt').read()")
        ).text == "(1, 'from parent')"
        # children of one fork never share random streams
        a, b = await _randoms(kids[0]), await _randoms(kids[1])
        assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)
    finally:
        for kid in kids:
            await kid.close()
    assert (await sandbox.run_code("len(data)")).text == "100000"  # the parent goes on


def _fork_copies(service: Service, sandbox_id: str) -> list[dict[str, object]]:
    """The service's ``vm.fork_copied`` log lines of forks of ``sandbox_id`` (bound per request)."""
    return [e for e in service.log_events("vm.fork_copied") if e.get("sandbox_id") == sandbox_id]


async def test_fork_copies_pages_of_a_clone_of_a_fork_and_whole_ram_of_a_woken_parent(
    service: Service,
) -> None:
    """A clone forks page by page (its written pages over its template's RAM file); a fork's
    child forks again page by page from a RAM file whose name is gone; a sandbox woken from disk
    (its RAM shared, no base file) is copied whole. Every child holds what its parent held."""
    parent = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    made: list[AsyncSandbox] = [parent]
    try:
        await parent.run_code("import os\nblob = os.urandom(20_000_000)\ndigest = hash(blob)")
        [child] = await parent.fork(1)
        made.append(child)
        [grandchild] = await child.fork(1)
        made.append(grandchild)
        await grandchild.run_code("extra = 'grandchild'")
        for sbx in (child, grandchild):
            assert (await sbx.run_code("hash(blob) == digest and len(blob)")).text == "20000000"
        assert (await grandchild.run_code("extra")).text == "'grandchild'"
        for sbx in (parent, child):
            copies = _fork_copies(service, sbx.id)
            assert [c["how"] for c in copies] == ["pages"], copies
        # the parent's 20 MB are pages it wrote; its child's are its base file's (that file,
        # unlinked, is what the grandchild's copy starts from)
        [copied] = _fork_copies(service, parent.id)
        assert isinstance(written := copied["written_mib"], int) and written >= 19, copied

        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
            r = await http.post(f"{service.url}/v1/sandboxes/{grandchild.id}/hibernate")
            assert r.status == 200, await r.text()
        [woken_child] = await grandchild.fork(1)  # wakes it first: its RAM is then shared
        made.append(woken_child)
        assert (await woken_child.run_code("extra, hash(blob) == digest")).text == "('grandchild', True)"
        copies = _fork_copies(service, grandchild.id)
        assert [c["how"] for c in copies] == ["whole"], copies
    finally:
        for sbx in reversed(made):
            await sbx.close()


async def _eventually(
    probe: Callable[[], Awaitable[T]], ok: Callable[[T], bool], what: str, timeout: float = 30
) -> T:
    """``probe()`` again until ``ok`` holds for what it returns (that value), at most ``timeout``
    seconds; else the test fails naming ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    while not ok(seen := await probe()):
        assert time.monotonic() < deadline, f"{what}: {seen!r}"
        await asyncio.sleep(0.2)
    return seen


async def _labels(service: Service) -> dict[str, dict[str, str]]:
    """Every domain of the service and its metadata."""
    hv = service.hypervisor()
    try:
        return {d.name: d.metadata for d in hv.domains()}
    finally:
        hv.close()


async def _spare_vms(service: Service, template: str, count: int) -> list[str]:
    """The ``count`` paused QEMUs the service started on its spare RAM copy of ``template``."""
    want = {"role": "fork-spare", "template": template}

    async def spares() -> list[str]:
        return [name for name, meta in (await _labels(service)).items() if meta == want]

    found = await _eventually(spares, lambda f: len(f) >= count, f"not {count} spare QEMUs after a fork", 60)
    assert len(found) == count, found
    return found


async def test_a_fork_after_another_makes_its_children_in_the_qemus_started_on_the_spare(
    service: Service,
) -> None:
    """After a fork(2) from a clone, the next copy of the template's RAM file gets two paused
    QEMUs: the next fork(2)'s children are those QEMUs, labelled with their sandboxes, holding
    the parent's state with random streams of their own, gone with their sandboxes. A fork(1)
    from the next spare takes one and destroys the other."""
    parent = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    made: list[AsyncSandbox] = [parent]

    def labels() -> Awaitable[dict[str, dict[str, str]]]:
        return _labels(service)

    try:
        await parent.run_code("marker = 'parent state'")
        made += await parent.fork(2)
        spares = await _spare_vms(service, "python", 2)
        kids = await parent.fork(2)
        made += kids
        for kid in kids:
            assert (await kid.run_code("marker")).text == "'parent state'"
        assert _fork_copies(service, parent.id)[-1]["prestarted"] == 2
        a, b = await _randoms(kids[0]), await _randoms(kids[1])
        assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)
        want = {kid.id for kid in kids}
        await _eventually(
            labels,
            lambda seen: {m.get("sandbox") for d, m in seen.items() if d in spares} == want,
            "the spares' QEMUs are not labelled with their sandboxes",
        )
        for kid in kids:
            await kid.close()
            made.remove(kid)
        gone = "a spare's QEMU outlived its sandbox"
        await _eventually(labels, lambda seen: not set(spares) & set(seen), gone)

        spares = await _spare_vms(service, "python", 2)
        [one] = await parent.fork(1)
        made.append(one)
        assert (await one.run_code("marker")).text == "'parent state'"
        assert _fork_copies(service, parent.id)[-1]["prestarted"] == 1
        await _eventually(  # the one the fork left is destroyed
            labels,
            lambda seen: len(set(spares) & set(seen)) == 1,
            "the spare QEMU the fork left is still running",
        )
    finally:
        for sbx in reversed(made):
            await sbx.close()


async def test_sandboxes_from_one_template_do_not_share_random_streams(
    sandbox: AsyncSandbox, fresh_sandbox: AsyncSandbox
) -> None:
    a, b = await _randoms(sandbox), await _randoms(fresh_sandbox)
    assert all(x != y for x, y in zip(a, b, strict=True)), (a, b)


async def test_a_new_sandbox_shows_no_trace_of_its_template_warm_up(fresh_sandbox: AsyncSandbox) -> None:
    """The template ran a few cells before it was frozen (so a clone's first call is fast); a
    user's first cell is still number 1 in a namespace like a fresh kernel's."""
    first = await fresh_sandbox.run_code(
        "import sys\n"
        "(repr(_), hasattr(sys, 'last_value'), len(Out), "
        "sorted(k for k in globals() if k[:1] == '_' and k[1:].isdigit()))"
    )
    assert first.error is None, first.error
    assert first.text == "(\"''\", False, 0, [])", first.text
    assert first.execution_count == 1
    assert first.stdout == "", first.stdout  # nothing of the pool's warm-up cells comes along


async def test_hibernate_on_idle_then_wake_with_state_and_a_fresh_clock(service: Service) -> None:
    sbx = await AsyncSandbox.create(idle_timeout_seconds=2, url=service.url, api_key=service.api_key)
    try:
        await sbx.run_code("kept = {'answer': 42}\nopen('/tmp/kept', 'w').write('on disk')")
        await _wait_state(service, sbx.id, "hibernated")
        saved = service.state_dir / "hibernated" / f"{sbx.id}.state"
        assert saved.is_file() and saved.stat().st_size > 1_000_000
        await asyncio.sleep(3)  # the guest clock stands still while hibernated
        woken = await sbx.run_code(
            "import time\nprint(time.time())\n(kept['answer'], open('/tmp/kept').read())"
        )
        host_now = time.time()
        assert woken.text == "(42, 'on disk')"
        assert abs(float(woken.stdout) - host_now) < 1.0
        assert await _state(service, sbx.id) == "running"
        assert not saved.exists()
    finally:
        await sbx.close()


async def test_deleting_a_hibernated_sandbox_removes_its_saved_state(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
        r = await http.post(f"{service.url}/v1/sandboxes/{sbx.id}/hibernate")
        assert r.status == 200 and (await r.json())["state"] == "hibernated"
    saved = service.state_dir / "hibernated" / f"{sbx.id}.state"
    assert saved.is_file()
    hv = service.hypervisor()
    try:
        assert not [d for d in hv.domains() if d.metadata.get("sandbox") == sbx.id]
    finally:
        hv.close()
    await sbx.close()
    assert not saved.exists()


async def test_restart_racing_hibernate_and_delete_leaves_a_working_sandbox_or_nothing(
    service: Service,
) -> None:
    """Restart, hibernate and delete of one sandbox at once (what an API fuzzer found): each call
    gets a clear answer, the sandbox ends up either working or gone, and nothing leaks."""
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    url = f"{service.url}/v1/sandboxes/{sbx.id}"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:

        async def post(action: str) -> int:
            async with http.post(f"{url}/{action}") as r:
                body = await r.json()
                assert r.status in (200, 404, 409), (action, r.status, body)
                return r.status

        statuses = await asyncio.gather(
            post("hibernate"), post("restart"), post("hibernate"), post("restart")
        )
        assert statuses.count(200) >= 2, statuses
        ran = await sbx.run_code("21 * 2")
        assert ran.text == "42", ran
        # now a delete in the middle of a restart and a hibernation
        deleting = asyncio.ensure_future(sbx.close())
        await asyncio.gather(post("restart"), post("hibernate"), deleting)
        async with http.get(url) as r:
            assert r.status == 404
    saved = service.state_dir / "hibernated" / f"{sbx.id}.state"
    hv = service.hypervisor()
    try:
        for _ in range(40):  # a replacement the delete overtook tears its VM down on its own
            left = [d.name for d in hv.domains() if d.metadata.get("sandbox") == sbx.id]
            if not left:
                break
            await asyncio.sleep(0.5)
        assert not left and not saved.exists(), (left, saved)
    finally:
        hv.close()


async def test_pool_refills_after_being_drained(service: Service) -> None:
    async def pool() -> int:
        async with aiohttp.ClientSession() as http:
            r = await http.get(f"{service.url}/healthz")
            return int((await r.json())["pool"]["python"])

    deadline = time.monotonic() + 120
    while await pool() < 2:
        assert time.monotonic() < deadline, "pool never filled"
        await asyncio.sleep(0.5)
    taken = [await AsyncSandbox.create(url=service.url, api_key=service.api_key) for _ in range(3)]
    try:
        assert await pool() < 2
        deadline = time.monotonic() + 120
        while await pool() < 2:
            assert time.monotonic() < deadline, "pool did not refill"
            await asyncio.sleep(0.5)
        for sbx in taken:
            assert (await sbx.run_code("6 * 7")).text == "42"
    finally:
        for sbx in taken:
            await sbx.close()
