"""Executions through real VMs: rich results, the datasci template, bash, the timeout ladder,
kernel and VM death, interrupt/restart, output caps, files, usage figures.

These tests run their own ``kernelhost serve`` (module scoped), because two of them need a shape
the shared service does not have: ``print('x' * 10**9)`` builds a 1 GB string in the guest, so
its VMs get 1536 MiB, and the ladder's rungs are shortened (grace 3 s, agent timeout 5 s) so the
whole ladder is exercised in seconds. Tests that end in a fresh VM use a sandbox of their own.

Fixture graph (module scoped)::

    execution_service ──> py  (python sandbox)        shared by read-mostly tests
                  └─> ds  (python-datasci sandbox)
                  └─> fresh (function)            a new python sandbox, closed after the test
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox, Result, Sandbox
from kernelhost.client import InvalidRequestError, NotFoundError

from ..harness import REPO, Service

pytestmark = pytest.mark.vm

MAX_OUTPUT = 1 << 20  # this service's max_output_bytes
MAX_RESULT = 4 << 20  # this service's max_result_bytes
MAX_FILE = 120 << 20  # this service's max_file_bytes
GRACE = 3.0
AGENT_TIMEOUT = 5.0


@pytest.fixture(scope="module")
def execution_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service.make(
        tmp_path_factory.mktemp("execution"),
        KERNELHOST_VM_MEMORY_MIB="1536",
        KERNELHOST_POOL_SIZE="1",
        KERNELHOST_INTERRUPT_GRACE=str(GRACE),
        KERNELHOST_AGENT_TIMEOUT=str(AGENT_TIMEOUT),
        KERNELHOST_RESTART_TIMEOUT="60",
        KERNELHOST_MAX_OUTPUT_BYTES=str(MAX_OUTPUT),
        KERNELHOST_MAX_RESULT_BYTES=str(MAX_RESULT),
        KERNELHOST_MAX_FILE_BYTES=str(MAX_FILE),
    )
    svc.start()
    try:
        yield svc
    finally:
        leaked, leaked_dirs = svc.cleanup()
        (REPO / "results").mkdir(exist_ok=True)
        (REPO / "results" / "vm-execution-service.log").write_bytes(svc.log_path.read_bytes())
        assert not leaked, f"domains left behind: {leaked}"
        assert not leaked_dirs, f"VM directories left behind: {leaked_dirs}"


def _open(svc: Service, template: str = "python") -> AsyncSandbox:
    return AsyncSandbox(template=template, url=svc.url, api_key=svc.api_key)


@pytest.fixture(scope="module")
async def py(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service) as sbx:
        yield sbx


@pytest.fixture(scope="module")
async def ds(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service, "python-datasci") as sbx:
        yield sbx


@pytest.fixture
async def fresh(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service) as sbx:
        yield sbx


async def _alive(sbx: AsyncSandbox) -> None:
    """The sandbox answers, quickly, on a working kernel."""
    t0 = time.monotonic()
    execution = await sbx.run_code("6 * 7", timeout=60)
    assert execution.status == "ok" and execution.text == "42", execution
    assert time.monotonic() - t0 < 30


# -- rich results ---------------------------------------------------------------------------------


async def test_rich_results_stream_in_order_as_mime_bundles(py: AsyncSandbox) -> None:
    seen: list[tuple[str, object]] = []
    execution = await py.run_code(
        "from IPython.display import display, HTML, SVG, JSON, Markdown\n"
        "print('before')\n"
        "display(HTML('<table><tr><td>1</td></tr></table>'))\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>\'))\n'
        "display(JSON({'a': [1, 2]}))\n"
        "display(Markdown('**bold**'))\n"
        "print('after')\n"
        "{'value': 1}",
        on_stdout=lambda t: seen.append(("stdout", t)),
        on_result=lambda r: seen.append(("result", r.formats())),
    )
    assert execution.error is None
    # ipykernel may split one print into several stream messages under load ("after", "\n"):
    # the order is what counts, so consecutive stdout chunks count as one
    kinds = [
        kind
        for i, (kind, _) in enumerate(seen)
        if not (kind == "stdout" and i > 0 and seen[i - 1][0] == "stdout")
    ]
    assert kinds == ["stdout", "result", "result", "result", "result", "stdout", "result"]
    assert execution.stdout == "before\nafter\n"
    html, svg, js, md, value = execution.results
    assert html.html is not None, html
    assert "<table>" in html.html and "text/plain" in html.formats()
    assert svg.svg is not None and svg.svg.startswith("<svg")
    assert js.json == {"a": [1, 2]}
    assert md.markdown == "**bold**"
    assert value.is_main_result and value.text == "{'value': 1}"
    assert [r.is_main_result for r in execution.results] == [False] * 4 + [True]


async def test_a_display_updated_in_a_loop_is_one_result_and_its_updates(
    py: AsyncSandbox, execution_service: Service
) -> None:
    service = execution_service
    code = (
        "from IPython.display import display\n"
        "handle = display('step 0', display_id=True)\n"
        "for i in range(1, 21):\n"
        "    handle.update(f'step {i}')\n"
        "display('another')"
    )
    seen: list[Result] = []
    execution = await py.run_code(code, on_result=seen.append)
    assert execution.error is None
    assert [(r.is_update, r.text) for r in seen[:2]] == [(False, "'step 0'"), (True, "'step 1'")]
    assert [r.is_update for r in seen] == [False] + [True] * 20 + [False]
    assert len({r.display_id for r in seen[:21]}) == 1 and seen[0].display_id
    assert [r.text for r in execution.results] == ["'step 20'", "'another'"]
    # the wire: one result with the id, then update_display events carrying it
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
        r = await http.post(f"{service.url}/v1/sandboxes/{py.id}/execute", json={"code": code})
        events = [json.loads(line) for line in (await r.text()).splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds == ["result"] + ["update_display"] * 20 + ["result", "end"]
    assert {e["display_id"] for e in events[:21]} == {events[0]["display_id"]}
    assert "display_id" not in events[21]  # a plain display has none


async def test_result_over_the_cap_keeps_its_text_with_a_marker(py: AsyncSandbox) -> None:
    execution = await py.run_code("from IPython.display import HTML\nHTML('<p>' + 'x' * 5_000_000 + '</p>')")
    [result] = execution.results
    assert result.html is None
    assert "max_result_bytes" in (result.text or "") and "text/html" in (result.text or "")
    assert execution.status == "ok"


async def test_datasci_plot_is_a_png_and_dataframe_is_html(ds: AsyncSandbox) -> None:
    plot = await ds.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('no show() needed')", timeout=180
    )
    assert plot.error is None, plot.error
    pngs = [r.png for r in plot.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 1000
    frame = await ds.run_code(
        "import numpy as np, pandas as pd, scipy.linalg\n"
        "pd.DataFrame({'x': np.arange(3), 'det': [scipy.linalg.det(np.eye(2))] * 3})",
        timeout=180,
    )
    assert frame.error is None, frame.error
    [table] = frame.results
    assert table.is_main_result and table.html is not None and "<table" in table.html and "det" in table.html
    tooling = await ds.run_code("import shutil\n[shutil.which(c) for c in ('gcc', 'g++', 'cc')]", timeout=60)
    assert tooling.text == "[None, None, None]"  # scipy came without a compiler toolchain


# -- bash -----------------------------------------------------------------------------------------


async def test_bash_streams_returns_exit_code_and_keeps_cwd_and_exports(py: AsyncSandbox) -> None:
    chunks: list[tuple[float, str]] = []
    first = await py.run_code(
        "mkdir -p /tmp/work && cd /tmp/work\n"
        "export GREETING=hello\n"
        "echo start; sleep 2; echo done; echo oops >&2",
        language="bash",
        timeout=60,
        on_stdout=lambda t: chunks.append((time.monotonic(), t)),
    )
    returned = time.monotonic()
    assert first.status == "ok" and first.exit_code == 0 and first.error is None
    assert first.stdout == "start\ndone\n" and first.stderr == "oops\n"
    assert chunks[0][1] == "start\n" and chunks[0][0] < returned - 1.5  # streamed, not at the end
    second = await py.run_code(
        "pwd; echo $GREETING; echo -n data > f.txt; exit 3", language="bash", timeout=60
    )
    assert second.stdout == "/tmp/work\nhello\n"
    assert second.status == "error" and second.exit_code == 3
    assert second.error is not None and "code 3" in second.error.value
    # the same VM and filesystem as the kernel
    shared = await py.run_code("open('/tmp/work/f.txt').read()")
    assert shared.text == "'data'"


async def test_bash_stdin_is_empty_and_python_input_fails_fast(py: AsyncSandbox) -> None:
    t0 = time.monotonic()
    read = await py.run_code('read -r line; echo "got [$line] rc=$?"', language="bash", timeout=30)
    assert read.stdout == "got [] rc=1\n"
    asked = await py.run_code("name = input('name? ')", timeout=30)
    assert asked.status == "error" and asked.error is not None
    assert asked.error.name == "StdinNotImplementedError"
    assert "without a terminal" in asked.error.value
    assert time.monotonic() - t0 < 25  # neither waited for an answer


# -- the timeout ladder ---------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(1000)"])
async def test_timeout_interrupts_and_keeps_state(py: AsyncSandbox, code: str) -> None:
    await py.run_code("kept = 'yes'")
    t0 = time.monotonic()
    execution = await py.run_code(code, timeout=2)
    took = time.monotonic() - t0
    assert execution.status == "timeout" and execution.recovery == "interrupted"
    assert execution.error is not None and execution.error.name == "TimeoutError"
    assert "KeyboardInterrupt" in execution.error.value and execution.error.traceback
    assert took < 2 + GRACE + 10
    assert (await py.run_code("kept")).text == "'yes'"


async def test_long_numpy_computation_ends_at_the_timeout(ds: AsyncSandbox) -> None:
    """BLAS does not look at signals: the interrupt waits, so the kernel is restarted."""
    await ds.run_code("import numpy as np\nbefore = 1")
    t0 = time.monotonic()
    execution = await ds.run_code("a = np.random.rand(3000, 3000)\nb = a @ a @ a @ a", timeout=3)
    took = time.monotonic() - t0
    assert execution.status == "timeout"
    assert execution.recovery in ("interrupted", "kernel_restarted"), execution.error
    assert took < 3 + GRACE + AGENT_TIMEOUT + 60
    after = await ds.run_code("import numpy as np\nint(np.arange(4).sum())", timeout=120)
    assert after.text == "6"


async def test_kernel_ignoring_sigint_is_restarted(py: AsyncSandbox) -> None:
    await py.run_code("doomed = 1")
    execution = await py.run_code(
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", timeout=2
    )
    assert execution.status == "timeout" and execution.recovery == "kernel_restarted"
    assert execution.error is not None and "restarted" in execution.error.value
    gone = await py.run_code("doomed")
    assert gone.error is not None and gone.error.name == "NameError"
    await _alive(py)


async def test_frozen_agent_gets_the_sandbox_a_new_vm(fresh: AsyncSandbox) -> None:
    await fresh.files.write("/tmp/before.txt", b"x")
    t0 = time.monotonic()
    execution = await fresh.run_code(
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nwhile True:\n    pass", timeout=2
    )
    assert execution.status == "timeout" and execution.recovery == "vm_replaced", execution.error
    assert execution.error is not None and "fresh VM" in execution.error.value
    assert time.monotonic() - t0 < 2 + GRACE + AGENT_TIMEOUT + 90
    await _alive(fresh)
    with pytest.raises(NotFoundError):
        await fresh.files.read("/tmp/before.txt")  # a new VM: files are gone too
    assert (await fresh.info()).state == "running"


async def test_bash_timeout_interrupts_then_kills(py: AsyncSandbox) -> None:
    interrupted = await py.run_code("sleep 1000", language="bash", timeout=2)
    assert interrupted.status == "timeout" and interrupted.recovery == "interrupted"
    stubborn = await py.run_code("trap '' INT; while :; do :; done", language="bash", timeout=2)
    assert stubborn.status == "timeout" and stubborn.recovery == "killed"
    assert stubborn.error is not None and "killed" in stubborn.error.value
    assert (await py.run_code("echo fine", language="bash", timeout=30)).stdout == "fine\n"


# -- kernel and VM death --------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["import os\nos._exit(1)", "import ctypes\nctypes.string_at(0)"])
async def test_dead_kernel_is_reported_and_next_call_gets_a_fresh_one(py: AsyncSandbox, code: str) -> None:
    await py.run_code("lost = 1")
    died = await py.run_code(code, timeout=60)
    assert died.status == "kernel_died" and died.recovery == "kernel_restarted"
    assert died.error is not None and died.error.name == "KernelDied"
    after = await py.run_code("'lost' in globals()", timeout=120)
    assert after.text == "False"


async def test_vm_that_dies_is_replaced(fresh: AsyncSandbox) -> None:
    """Killing the guest agent makes the guest panic and libvirt destroy the VM."""
    execution = await fresh.run_code("import os\nos.kill(os.getppid(), 9)", timeout=60)
    assert execution.status == "kernel_died" and execution.recovery == "vm_replaced"
    assert execution.error is not None and execution.error.name == "SandboxLost"
    await _alive(fresh)


# -- interrupt and restart ------------------------------------------------------------------------


async def test_interrupt_and_restart_do_not_wait_for_the_running_call(py: AsyncSandbox) -> None:
    await py.run_code("survivor = 'here'")
    running = asyncio.create_task(py.run_code("import time\nfor i in range(1000):\n    time.sleep(1)"))
    await asyncio.sleep(2)
    assert await py.interrupt() is True
    stopped = await asyncio.wait_for(running, 30)
    assert stopped.status == "interrupted"
    assert stopped.error is not None and stopped.error.name == "KeyboardInterrupt"
    assert (await py.run_code("survivor")).text == "'here'"

    running = asyncio.create_task(py.run_code("import time\ntime.sleep(1000)"))
    await asyncio.sleep(2)
    assert await py.restart() == "kernel_restarted"
    ended = await asyncio.wait_for(running, 30)
    assert ended.status == "restarted"
    gone = await py.run_code("survivor")
    assert gone.error is not None and gone.error.name == "NameError"
    assert await py.interrupt() is False  # nothing runs


async def test_interrupt_reaches_a_bash_command(py: AsyncSandbox) -> None:
    running = asyncio.create_task(py.run_code("echo go; sleep 1000", language="bash"))
    await asyncio.sleep(2)
    assert await py.interrupt() is True
    stopped = await asyncio.wait_for(running, 30)
    assert stopped.status == "interrupted" and stopped.exit_code == 130
    assert stopped.stdout == "go\n"


async def test_client_disconnect_interrupts_the_call(fresh: AsyncSandbox, execution_service: Service) -> None:
    # a sandbox of its own: right after another test's restart, the shared one's vCPU also starts
    # its next standby kernel, and the interrupt could miss this service's 3 s grace
    py = fresh
    await py.run_code("still = 'there'")
    auth = {"Authorization": f"Bearer {execution_service.api_key}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        resp = await http.post(
            f"{execution_service.url}/v1/sandboxes/{py.id}/execute",
            json={"code": "print('spinning', flush=True)\nwhile True:\n    pass"},
        )
        assert (await asyncio.wait_for(resp.content.readline(), 30)).startswith(b'{"type":"stdout"')
        resp.close()  # hang up mid-call, no timeout given
    t0 = time.monotonic()
    after = await py.run_code("still", timeout=60)  # would queue forever behind the spin
    assert after.text == "'there'" and time.monotonic() - t0 < 30


# -- output limits --------------------------------------------------------------------------------


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def test_printing_forever_is_cut_at_the_cap_and_host_memory_stays_flat(
    py: AsyncSandbox, execution_service: Service
) -> None:
    assert execution_service.proc is not None
    pid = execution_service.proc.pid
    # the guest's first GiB string faults in a GiB of fresh VM memory (seconds under emulation,
    # many more under a loaded CI machine): paid here, outside the flood's 20 s
    warm = await py.run_code("x = 'x' * 10**9\ndel x", timeout=120)
    assert warm.status == "ok", warm.error
    baseline = _rss(pid)
    samples: list[int] = []

    async def sample() -> None:
        while True:
            samples.append(_rss(pid))
            await asyncio.sleep(0.2)

    sampler = asyncio.create_task(sample())
    try:
        flood = await py.run_code("while True:\n    print('x' * 10**9)", timeout=20)
    finally:
        sampler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sampler
    assert flood.status == "timeout" and flood.output_truncated, (flood.status, len(flood.stdout))
    assert flood.stdout.startswith("x" * 1000)
    assert "output truncated" in flood.stdout and "max_output_bytes" in flood.stdout
    assert MAX_OUTPUT <= len(flood.stdout.encode()) < MAX_OUTPUT + 1000
    # the service kept no more than a few frames of it at any time
    assert max(samples) - baseline < 64 << 20, (baseline, max(samples))
    bash = await py.run_code("yes | head -c 50000000", language="bash", timeout=60)
    assert bash.output_truncated and len(bash.stdout.encode()) < MAX_OUTPUT + 1000
    assert bash.exit_code == 0


# -- files ----------------------------------------------------------------------------------------


async def test_100_mb_file_round_trips_byte_for_byte(py: AsyncSandbox, tmp_path: Path) -> None:
    size = 100 * 1000 * 1000
    source = tmp_path / "big.bin"
    source.write_bytes(os.urandom(size))
    want = hashlib.sha256(source.read_bytes()).hexdigest()
    with source.open("rb") as f:
        info = await py.files.write("data/big.bin", f)
    assert info.path == "/home/user/data/big.bin" and info.size == size
    seen = await py.run_code(
        "import hashlib\nhashlib.sha256(open('data/big.bin', 'rb').read()).hexdigest()", timeout=300
    )
    assert seen.text == repr(want)
    target = tmp_path / "back.bin"
    assert await py.files.download("data/big.bin", target) == size
    assert hashlib.sha256(target.read_bytes()).hexdigest() == want
    listing = await py.files.list("data")
    assert [(e.name, e.type, e.size) for e in listing] == [("big.bin", "file", size)]
    await py.files.remove("data", recursive=True)


async def test_files_small_text_errors_and_limits(py: AsyncSandbox, execution_service: Service) -> None:
    await py.files.write("notes/a.txt", "héllo\n")
    assert await py.files.read_text("notes/a.txt") == "héllo\n"
    assert (await py.run_code("open('notes/a.txt').read()")).text == "'héllo\\n'"
    produced = await py.run_code("open('made_by_code.csv', 'w').write('a,b\\n1,2\\n')")
    assert produced.error is None
    assert await py.files.read("made_by_code.csv") == b"a,b\n1,2\n"
    with pytest.raises(NotFoundError) as missing:
        await py.files.read("no/such/file.txt")
    assert "no/such/file.txt" in str(missing.value)
    with pytest.raises(NotFoundError):
        await py.files.remove("no/such/file.txt")
    with pytest.raises(InvalidRequestError) as not_empty:
        await py.files.remove("notes")
    assert "recursive" in str(not_empty.value)
    with pytest.raises(InvalidRequestError) as is_dir:
        await py.files.read("notes")
    assert "directory" in str(is_dir.value)
    await py.files.remove("notes", recursive=True)
    assert "notes" not in [e.name for e in await py.files.list()]
    # over max_file_bytes: a sparse file is refused before a byte moves, naming the limit
    await py.run_code(f"open('/tmp/huge', 'wb').truncate({MAX_FILE + 1})")
    with pytest.raises(Exception) as too_big:
        await py.files.read("/tmp/huge")
    assert getattr(too_big.value, "status", None) == 413 and "max_file_bytes" in str(too_big.value)

    async def endless() -> AsyncIterator[bytes]:
        yield b"\0" * 1024
        await asyncio.sleep(60)  # the answer must come before the body does

    auth = {"Authorization": f"Bearer {execution_service.api_key}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        r = await asyncio.wait_for(
            http.put(
                f"{execution_service.url}/v1/sandboxes/{py.id}/files",
                params={"path": "x.bin"},
                data=endless(),
                headers={"Content-Length": str(MAX_FILE + 1)},
            ),
            30,
        )
        assert r.status == 413, await r.text()
        assert "max_file_bytes" in (await r.json())["error"]["message"]
        r = await http.get(f"{execution_service.url}/v1/sandboxes/{py.id}/files")
        assert r.status == 400 and "path" in (await r.json())["error"]["message"]
    await py.files.write("plain.txt", b"a file")
    with pytest.raises(InvalidRequestError) as not_dir:  # a parent is a file
        await py.files.write("plain.txt/child.txt", b"nope")
    assert any(code in str(not_dir.value) for code in ("ENOTDIR", "EEXIST"))
    assert [e.name for e in await py.files.list() if e.name.startswith(".")] == []


def test_sync_files_and_bash(execution_service: Service) -> None:
    with Sandbox(url=execution_service.url, api_key=execution_service.api_key) as sbx:
        sbx.files.write("hello.txt", b"from sync")
        assert sbx.files.read("hello.txt") == b"from sync"
        assert [e.name for e in sbx.files.list()] == ["hello.txt"]
        assert sbx.run_code("cat hello.txt", language="bash").stdout == "from sync"


# -- usage figures --------------------------------------------------------------------------------


async def test_each_execution_reports_wall_cpu_and_peak_memory(py: AsyncSandbox) -> None:
    idle = await py.run_code("import time\ntime.sleep(1)")
    busy = await py.run_code(
        "import time\nt = time.time()\nwhile time.time() - t < 1:\n    pass\n"
        "big = bytearray(200 * 2**20)\ndel big"
    )
    for execution in (idle, busy):
        assert execution.duration_ms is not None and execution.duration_ms >= 900
        assert execution.cpu_time_ms is not None and execution.peak_memory_bytes is not None
    # (the loop checked them; mypy does not narrow through it)
    assert busy.cpu_time_ms is not None and idle.cpu_time_ms is not None
    assert busy.peak_memory_bytes is not None and idle.peak_memory_bytes is not None
    assert busy.cpu_time_ms > 800 > idle.cpu_time_ms
    assert busy.peak_memory_bytes >= 200 * 2**20 > idle.peak_memory_bytes
    shell = await py.run_code("python3 -c 'b = bytearray(100 * 2**20)'", language="bash", timeout=60)
    assert shell.peak_memory_bytes is not None and shell.peak_memory_bytes >= 100 * 2**20
    assert shell.cpu_time_ms is not None and shell.cpu_time_ms > 0
    wire = json.dumps({"cpu": busy.cpu_time_ms, "peak": busy.peak_memory_bytes})
    assert wire  # JSON-ready figures
