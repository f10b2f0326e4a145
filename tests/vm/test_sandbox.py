"""The end-to-end path through real VMs: SDK -> HTTP API -> libvirt/QEMU -> guest agent -> ipykernel."""

from __future__ import annotations

import asyncio
import contextlib
import time

import aiohttp
import pytest

from kernelhost import AsyncSandbox, Result, Sandbox
from kernelhost.client import (
    AuthenticationError,
    InvalidRequestError,
    NotFoundError,
    RateLimitError,
)

from ..harness import Service

pytestmark = pytest.mark.vm


async def test_persistent_repl_keeps_variables_imports_and_files(sandbox: AsyncSandbox) -> None:
    first = await sandbox.run_code(
        "import json\n"
        "counter = 41\n"
        "with open('/tmp/note.txt', 'w') as f:\n"
        "    f.write('kept')\n"
        "print('stored')"
    )
    assert first.error is None and first.stdout == "stored\n"
    second = await sandbox.run_code("counter += 1\ncounter")
    assert second.error is None and second.text == "42"
    third = await sandbox.run_code(
        "print(json.dumps({'counter': counter, 'file': open('/tmp/note.txt').read()}))"
    )
    assert third.error is None
    assert third.stdout.strip() == '{"counter": 42, "file": "kept"}'
    assert first.execution_count is not None and second.execution_count is not None
    assert third.execution_count == second.execution_count + 1 == first.execution_count + 2


async def test_exception_reports_name_value_traceback_and_kernel_survives(sandbox: AsyncSandbox) -> None:
    failed = await sandbox.run_code("def boom():\n    return 1 / 0\nboom()")
    assert failed.status == "error"
    assert failed.error is not None
    assert failed.error.name == "ZeroDivisionError"
    assert failed.error.value == "division by zero"
    assert any("boom" in line for line in failed.error.traceback)
    after = await sandbox.run_code("'still alive'")
    assert after.error is None and after.text == "'still alive'"


async def test_stdout_streams_in_order_before_the_call_ends(sandbox: AsyncSandbox) -> None:
    seen: list[tuple[float, str]] = []
    code = (
        "import sys, time\n"
        "for i in range(5):\n"
        "    print(f'line {i}', flush=True)\n"
        "    if i == 0:\n"
        "        time.sleep(3)\n"
        "print('to stderr', file=sys.stderr)\n"
    )
    errs: list[str] = []
    execution = await sandbox.run_code(
        code, on_stdout=lambda text: seen.append((time.monotonic(), text)), on_stderr=errs.append
    )
    returned = time.monotonic()
    text = "".join(t for _, t in seen)
    assert text == "".join(f"line {i}\n" for i in range(5)) == execution.stdout
    assert errs and "".join(errs) == "to stderr\n" == execution.stderr
    # the first line was delivered while the cell was still sleeping, not at the end
    assert seen[0][0] < returned - 2.0


async def test_large_ascii_and_unicode_output_arrives_whole_and_in_order(sandbox: AsyncSandbox) -> None:
    # the kernel packs a large ASCII text "text first" and the agent relays it from the kernel's
    # own buffer; any other text takes the slow path (kernel_wire.py, streamwire.py): both arrive
    code = (
        "import sys\n"
        "ascii_part = ''.join(chr(32 + i % 95) for i in range(300_000)) + '\\n'\n"
        "unicode_part = 'caf\\u00e9 \\u20ac \\U0001F600 ' * 20_000 + '\\n'\n"
        "for part in (ascii_part, unicode_part, ascii_part):\n"
        "    sys.stdout.write(part)\n"
        "    sys.stdout.flush()\n"
        "sys.stderr.write(ascii_part)\n"
    )
    ascii_part = "".join(chr(32 + i % 95) for i in range(300_000)) + "\n"
    unicode_part = "caf\u00e9 \u20ac \U0001f600 " * 20_000 + "\n"
    out: list[str] = []
    execution = await sandbox.run_code(code, on_stdout=out.append, timeout=120)
    assert execution.status == "ok" and not execution.output_truncated
    assert "".join(out) == execution.stdout == ascii_part + unicode_part + ascii_part
    assert execution.stderr == ascii_part


async def test_results_are_mime_bundles(sandbox: AsyncSandbox) -> None:
    got: list[Result] = []
    execution = await sandbox.run_code(
        "from IPython.display import display, HTML\ndisplay(HTML('<b>bold</b>'))\n{'a': 1}",
        on_result=got.append,
    )
    assert [r.is_main_result for r in execution.results] == [False, True]
    assert execution.results[0].html == "<b>bold</b>"
    assert execution.results[1].text == "{'a': 1}"
    assert len(got) == 2


async def test_two_sandboxes_do_not_share_state(sandbox: AsyncSandbox, fresh_sandbox: AsyncSandbox) -> None:
    await sandbox.run_code("secret = 'mine'\nopen('/tmp/secret', 'w').write('x')")
    other = await fresh_sandbox.run_code("secret")
    assert other.error is not None and other.error.name == "NameError"
    files = await fresh_sandbox.run_code("import os\nos.path.exists('/tmp/secret')")
    assert files.text == "False"
    assert (await sandbox.run_code("secret")).text == "'mine'"


async def test_close_leaves_no_domain_socket_or_file(service: Service) -> None:
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    hv = service.hypervisor()
    try:
        # a pooled clone is labelled with its sandbox just after the hand-over, off its path
        deadline = time.monotonic() + 10
        while not (mine := [d for d in hv.domains() if d.metadata.get("sandbox") == sbx.id]):
            assert time.monotonic() < deadline, "the sandbox's domain was never labelled"
            await asyncio.sleep(0.05)
        [info] = mine
        vm_dir = hv.vm_dir(info.name)
        assert (vm_dir / "agent.sock").exists() and hv.is_running(info.name)
        await sbx.close()
        assert not hv.is_running(info.name)
        assert info.name not in [d.name for d in hv.domains()]
        assert not vm_dir.exists()
        with pytest.raises(NotFoundError):
            await AsyncSandbox.connect(sbx.id, url=service.url, api_key=service.api_key)
    finally:
        await sbx.close()
        hv.close()


async def test_foreign_and_unknown_ids_are_404(sandbox: AsyncSandbox, service: Service) -> None:
    with pytest.raises(NotFoundError) as err:
        await AsyncSandbox.connect(sandbox.id, url=service.url, api_key=service.other_key)
    assert sandbox.id in str(err.value)
    with pytest.raises(NotFoundError):
        await AsyncSandbox.connect("sbx_doesnotexist", url=service.url, api_key=service.api_key)
    listed = await AsyncSandbox.list(url=service.url, api_key=service.other_key)
    assert sandbox.id not in [s.id for s in listed]
    async with aiohttp.ClientSession() as http:
        r = await http.post(
            f"{service.url}/v1/sandboxes/{sandbox.id}/execute",
            json={"code": "secret"},
            headers={"Authorization": f"Bearer {service.other_key}"},
        )
        assert r.status == 404


async def test_missing_or_wrong_key_is_401(service: Service) -> None:
    async with aiohttp.ClientSession() as http:
        r = await http.get(f"{service.url}/v1/sandboxes")
        assert r.status == 401
        body = await r.json()
        assert body["error"]["code"] == "unauthorized" and "Authorization" in body["error"]["message"]
        r = await http.get(f"{service.url}/v1/sandboxes", headers={"Authorization": "Bearer nope"})
        assert r.status == 401
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.list(url=service.url, api_key="wrong-key-wrong-key")


async def test_per_key_limits_queue_then_answer_429_and_other_keys_go_on(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A key at its limit: a create waits its turn (one may wait), the next is 429 at once with
    when to come back, a caller that will not wait is 429 at once; another key goes on."""
    svc = Service.make(
        tmp_path,
        KERNELHOST_MAX_SANDBOXES_PER_KEY="1",
        KERNELHOST_POOL_SIZE="1",
        KERNELHOST_CREATE_QUEUE_SECONDS="120",
        KERNELHOST_CREATE_QUEUE_LENGTH="1",
    )
    svc.start()
    waiting: asyncio.Task[AsyncSandbox] | None = None
    try:
        first = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        headers = {"Authorization": f"Bearer {svc.api_key}"}
        async with aiohttp.ClientSession(headers=headers) as http:
            now = await http.post(
                f"{svc.url}/v1/sandboxes", json={}, headers={"X-Kernelhost-Queue-Wait": "0"}
            )
            assert now.status == 429 and "max_sandboxes_per_key" in (await now.json())["error"]["message"]
            waiting = asyncio.create_task(AsyncSandbox.create(url=svc.url, api_key=svc.api_key))
            await asyncio.sleep(2)  # it joins the key's queue
            assert not waiting.done()
            full = await http.post(f"{svc.url}/v1/sandboxes", json={})
            assert full.status == 429 and int(full.headers["Retry-After"]) >= 1
            assert "create_queue_length" in (await full.json())["error"]["message"]
        with pytest.raises(RateLimitError) as err:  # a fork makes sandboxes too: the queue is full
            await first.fork(1)
        assert err.value.status == 429 and "max_sandboxes_per_key" in str(err.value)
        other = await AsyncSandbox.create(url=svc.url, api_key=svc.other_key)  # its own budget
        assert (await other.run_code("1 + 1")).text == "2"
        await first.close()  # room: the waiting create is made
        second = await asyncio.wait_for(waiting, 120)
        assert second.queued_seconds is not None and second.queued_seconds > 1, second.queued_seconds
        assert (await second.run_code("2 + 2")).text == "4"
        await second.close()
        await other.close()
    finally:
        if waiting is not None and not waiting.done():  # the test failed while it waited
            waiting.cancel()
            with contextlib.suppress(BaseException):
                await waiting
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs


async def test_bad_template_names_the_valid_ones(service: Service) -> None:
    with pytest.raises(InvalidRequestError) as err:
        await AsyncSandbox.create(template="no-such-template", url=service.url, api_key=service.api_key)
    assert err.value.status == 400
    assert "no-such-template" in str(err.value) and "python" in str(err.value)


async def test_bad_input_gets_a_clear_400(sandbox: AsyncSandbox, service: Service) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
        url = f"{service.url}/v1/sandboxes/{sandbox.id}/execute"
        for body, word in [
            ({}, "code"),
            ({"code": 1}, "code"),
            ({"code": "1", "timeout": -1}, "timeout"),
            ({"code": "1", "language": "cobol"}, "cobol"),
        ]:
            r = await http.post(url, json=body)
            assert r.status == 400, body
            assert word in (await r.json())["error"]["message"]
        r = await http.post(url, data=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status == 400 and "JSON" in (await r.json())["error"]["message"]


async def test_calls_to_one_sandbox_run_in_arrival_order(sandbox: AsyncSandbox) -> None:
    await sandbox.run_code("order = []")
    first = asyncio.create_task(sandbox.run_code("import time\ntime.sleep(1)\norder.append(1)"))
    await asyncio.sleep(0.2)
    second = asyncio.create_task(sandbox.run_code("order.append(2)"))
    await asyncio.wait_for(asyncio.gather(first, second), 60)
    assert (await sandbox.run_code("order")).text == "[1, 2]"


async def test_timeout_interrupts_and_sandbox_keeps_working(sandbox: AsyncSandbox) -> None:
    await sandbox.run_code("kept = 'yes'")
    timed_out = await sandbox.run_code("while True:\n    pass", timeout=2)
    assert timed_out.status == "timeout"
    assert timed_out.error is not None and timed_out.error.name in ("TimeoutError", "KeyboardInterrupt")
    assert (await sandbox.run_code("kept")).text == "'yes'"


def test_sync_sandbox_context_manager(client_env: Service) -> None:
    with Sandbox(template="python") as sbx:
        chunks: list[str] = []
        execution = sbx.run_code("x = 6 * 7\nprint(x)", on_stdout=chunks.append)
        assert execution.stdout == "42\n" and chunks == ["42\n"]
        assert sbx.run_code("x").text == "42"
        sandbox_id = sbx.id
    with pytest.raises(NotFoundError):
        Sandbox.connect(sandbox_id)


async def test_service_restart_reattaches_with_state(service: Service) -> None:
    """Running sandboxes are reattached and hibernated ones kept, variables intact."""
    sbx = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    sleeper = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    try:
        await sbx.run_code("survivor = [1, 2, 3]")
        await sleeper.run_code("dreamt = 'of sheep'")
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
            r = await http.post(f"{service.url}/v1/sandboxes/{sleeper.id}/hibernate")
            assert (await r.json())["state"] == "hibernated"
        service.stop()
        service.start()
        again = await AsyncSandbox.connect(sbx.id, url=service.url, api_key=service.api_key)
        woken = await AsyncSandbox.connect(sleeper.id, url=service.url, api_key=service.api_key)
        try:
            assert (await again.run_code("sum(survivor)")).text == "6"
            assert (await woken.info()).state == "hibernated"
            assert (await woken.run_code("dreamt")).text == "'of sheep'"
        finally:
            await again.close()
            await woken.close()
    finally:
        await sbx.close()
        await sleeper.close()


async def test_guest_cannot_fill_the_host_disk_through_its_serial_console(
    sandbox: AsyncSandbox, service: Service
) -> None:
    """The console log goes through virtlogd, which rotates it: at most 4 x 2 MiB per VM."""
    flood = await sandbox.run_code(
        "fd = open('/dev/ttyS0', 'wb', buffering=0)\n"
        "for _ in range(9):\n"
        "    fd.write(b'x' * 1024 * 1024)\n"
        "fd.close()",
        timeout=240,
    )
    assert flood.error is None, flood.error
    hv = service.hypervisor()
    try:
        [info] = [d for d in hv.domains() if d.metadata.get("sandbox") == sandbox.id]
        logs = list(hv.vm_dir(info.name).glob("console.log*"))
        assert logs and sum(p.stat().st_size for p in logs) <= 8 * 1024 * 1024
    finally:
        hv.close()
    assert (await sandbox.run_code("'still here'")).text == "'still here'"
