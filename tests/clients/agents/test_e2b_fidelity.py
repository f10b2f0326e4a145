"""Issue 37: E2B programs behave as they do on E2B. Each test drives E2B's own SDKs
(``e2b``, ``e2b-code-interpreter``, unmodified) through real VMs and checks one behaviour E2B
has and kernelhost lacked: the lifecycle (health, a kill mid-call, list order, connect and
set_timeout, timeouts on time, pause modes and auto_resume, update_network), envd (watchers
polled by id, remove, entries, write metadata, signed URLs), ``get_host(port)`` (a server in
the sandbox reached by its host name), the interpreter's string results, and the commands
E2B's images have.

The module runs its own service with the default ``reaper_interval`` (10 s), so that a
timeout firing late is seen."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest

from ...harness import Service, running_service
from .conftest import e2b_env

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

DOMAIN = "sandboxes.kh.test"  # resolves nowhere: a request names it in its Host header alone


@pytest.fixture(scope="module")
def fidelity_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("e2b-fidelity"), "e2b-fidelity", KERNELHOST_DOMAIN=DOMAIN
    ) as svc:
        yield svc


@pytest.fixture
def e2b(fidelity_service: Service, monkeypatch: pytest.MonkeyPatch) -> Service:
    for name, value in e2b_env(fidelity_service).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return fidelity_service


@pytest.fixture
def sandbox(e2b: Service) -> Iterator[Any]:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(metadata={"suite": "fidelity"})
    try:
        yield sbx
    finally:
        sbx.kill()


def _until(predicate: Any, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held (polled every 0.1 s); fails after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what} did not happen within {timeout}s"
        time.sleep(0.1)
    return time.monotonic() - start


# == lifecycle ====================================================================================


def test_1_health_says_a_paused_killed_or_unknown_sandbox_is_not_running(sandbox: Any) -> None:
    """E2B's proxy answers 502 for a sandbox that is not running: ``is_running()`` is False."""
    from e2b_code_interpreter import Sandbox

    assert sandbox.is_running() is True
    sandbox.pause()
    assert sandbox.is_running() is False, "a paused sandbox reported running"
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.is_running() is True
    again.kill()
    assert again.is_running() is False, "a killed sandbox reported running"


def test_2_a_sandbox_killed_mid_call_breaks_the_call_as_on_e2b(sandbox: Any) -> None:
    """The execute and command streams break (no clean end), so the SDKs raise their "the
    sandbox was killed" errors instead of a result or an exit code."""
    from e2b import TimeoutException
    from e2b.exceptions import SandboxNotRunningException

    handle = sandbox.commands.run("sleep 300", background=True)
    seen: dict[str, BaseException | object] = {}

    def run() -> None:
        try:
            seen["run_code"] = sandbox.run_code("import time; time.sleep(300)")
        except BaseException as exc:
            seen["run_code"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(3)  # the execution is under way
    sandbox.kill()
    thread.join(60)
    outcome = seen.get("run_code")
    assert isinstance(outcome, TimeoutException) and "sandbox was killed" in str(outcome), repr(outcome)
    with pytest.raises(SandboxNotRunningException, match="sandbox was killed"):  # not an exit code
        handle.wait()


def test_3_lists_are_newest_first_unless_asked_and_honour_started_after(e2b: Service) -> None:
    from e2b import SandboxQuery
    from e2b_code_interpreter import Sandbox

    first = Sandbox.create(metadata={"suite": "order"})
    time.sleep(1.5)
    between = datetime.now(UTC)
    time.sleep(1.5)
    second = Sandbox.create(metadata={"suite": "order"})
    try:
        query = SandboxQuery(metadata={"suite": "order"})
        ids = [s.sandbox_id for s in Sandbox.list(query=query).next_items()]
        assert ids == [second.sandbox_id, first.sandbox_id], "not newest first"
        ids = [s.sandbox_id for s in Sandbox.list(query=query, order="asc").next_items()]
        assert ids == [first.sandbox_id, second.sandbox_id]
        after = SandboxQuery(metadata={"suite": "order"}, started_after=between)
        assert [s.sandbox_id for s in Sandbox.list(query=after).next_items()] == [second.sandbox_id]
    finally:
        first.kill()
        second.kill()


def test_4_connect_only_extends_and_set_timeout_zero_ends_it_now(e2b: Service) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=600)
    try:
        end = sbx.get_info().end_at
        Sandbox.connect(sbx.sandbox_id, timeout=60)  # shorter: E2B keeps the later end
        assert sbx.get_info().end_at >= end, "connect(timeout) shortened the sandbox's life"
        Sandbox.connect(sbx.sandbox_id, timeout=1200)
        assert (sbx.get_info().end_at - end).total_seconds() > 500, "connect(timeout) did not extend it"
        sbx.set_timeout(0)  # E2B: it reaches its timeout now
        assert sbx.get_info().state.value == "paused"
        assert sbx.is_running() is False
    finally:
        sbx.kill()


def test_5_a_timeout_fires_on_time_and_does_what_on_timeout_says(e2b: Service) -> None:
    """timeout=3 with on_timeout="kill": gone within a second or two of its timeout (not at
    the reaper's next 10 s sweep, and not paused)."""
    from e2b.exceptions import SandboxNotFoundException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(timeout=3, lifecycle={"on_timeout": "kill"})
    start = time.monotonic()

    def gone() -> bool:
        try:
            state = Sandbox.get_info(sbx.sandbox_id).state.value
        except SandboxNotFoundException:
            return True
        assert state == "running", f"on_timeout='kill' ignored: the sandbox is {state}"
        return False

    try:
        _until(gone, 30, "the kill at the timeout")
        assert time.monotonic() - start < 3 + 2.5, f"killed {time.monotonic() - start:.1f}s after create"
    finally:
        Sandbox.kill(sbx.sandbox_id)


def test_5_pause_without_memory_keeps_the_files_only(sandbox: Any) -> None:
    """pause(mode="filesystem"): resumed, the files are there and the memory is not."""
    from e2b_code_interpreter import Sandbox

    sandbox.run_code("kept = 41")
    sandbox.files.write("/home/user/kept.txt", "on disk")
    sandbox.pause(mode="filesystem")
    again = Sandbox.connect(sandbox.sandbox_id)
    assert again.files.read("/home/user/kept.txt") == "on disk"
    gone = again.run_code("kept")
    assert gone.error is not None and gone.error.name == "NameError", "the memory was kept"


def test_5_auto_resume_off_waits_for_a_connect(e2b: Service) -> None:
    from e2b import TimeoutException
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(lifecycle={"on_timeout": "pause", "auto_resume": False})
    try:
        sbx.run_code("kept = 41")
        sbx.pause()
        with pytest.raises(TimeoutException):  # auto_resume off: a call does not wake it
            sbx.run_code("1 + 1")
        assert sbx.get_info().state.value == "paused"
        assert Sandbox.connect(sbx.sandbox_id).run_code("kept").text == "41"
    finally:
        sbx.kill()


def test_6_update_network_is_refused_naming_the_feature(sandbox: Any) -> None:
    from e2b.exceptions import SandboxException, SandboxNotFoundException

    with pytest.raises(SandboxException) as refused:
        sandbox.update_network({"allow_out": ["pypi.org"]})
    assert not isinstance(refused.value, SandboxNotFoundException), refused.value
    assert "update_network" in str(refused.value) and "not supported" in str(refused.value)


# == envd =========================================================================================


def test_7_the_sync_sdks_watch_dir_polls_a_watcher_by_id(sandbox: Any) -> None:
    from e2b import FilesystemEventType
    from e2b.exceptions import NotFoundException

    sandbox.files.make_dir("/home/user/polled/deep")
    handle = sandbox.files.watch_dir("/home/user/polled", recursive=True)
    seen: list[tuple[str, Any]] = []

    def saw(event: tuple[str, Any]) -> bool:
        seen.extend((e.name, e.type) for e in handle.get_new_events())
        return event in seen

    sandbox.files.write("/home/user/polled/deep/a.txt", "first")
    _until(lambda: saw(("deep/a.txt", FilesystemEventType.CREATE)), 60, "the create")
    count = len(seen)
    sandbox.files.remove("/home/user/polled/deep/a.txt")
    _until(lambda: saw(("deep/a.txt", FilesystemEventType.REMOVE)), 60, "the remove")
    assert seen[count:].count(("deep/a.txt", FilesystemEventType.CREATE)) == 0, "events came twice"
    handle.stop()
    handle._closed = False  # past the SDK's own check: the service removed the watcher
    with pytest.raises(NotFoundException):
        handle.get_new_events()


def test_8_removing_a_missing_path_succeeds(sandbox: Any) -> None:
    sandbox.files.remove("/home/user/never-there.txt")
    sandbox.files.remove("/home/user/never/there")


def test_9_entries_carry_mode_permissions_owner_and_target_and_list_depth_first(sandbox: Any) -> None:
    from e2b import FileType

    sandbox.commands.run(
        "mkdir -p t/a && echo z > t/a/z.txt && echo b > t/b.txt && chmod 600 t/b.txt && ln -s b.txt t/link"
    )
    entries = sandbox.files.list("/home/user/t", depth=2)
    assert [e.path for e in entries] == [
        "/home/user/t/a",
        "/home/user/t/a/z.txt",
        "/home/user/t/b.txt",
        "/home/user/t/link",
    ], "not depth first"
    by_name = {e.name: e for e in entries}
    b, a = by_name["b.txt"], by_name["a"]
    assert (b.mode, b.permissions, b.owner, b.group) == (0o600, "-rw-------", "user", "user"), b
    assert (a.type, a.permissions) == (FileType.DIR, "drwxr-xr-x"), a
    link = by_name["link"]
    assert link.type == FileType.SYMLINK and link.symlink_target == "/home/user/t/b.txt", link
    assert link.permissions == "Lrwxrwxrwx", link
    info = sandbox.files.get_info("/home/user/t/link")
    assert info.symlink_target == "/home/user/t/b.txt" and info.owner == "user", info


def test_10_write_metadata_is_refused_by_the_sdk_not_dropped(sandbox: Any) -> None:
    from e2b import TemplateException

    with pytest.raises(TemplateException, match="metadata"):
        sandbox.files.write("/home/user/m.txt", "x", metadata={"owner": "me"})
    assert sandbox.files.write("/home/user/m.txt", "x").path == "/home/user/m.txt"


def test_11_signed_urls_download_and_upload_one_file_of_one_sandbox(e2b: Service, sandbox: Any) -> None:
    from e2b_code_interpreter import Sandbox

    sandbox.files.write("/home/user/signed.txt", "mine")
    theirs = Sandbox.create(api_key=e2b.other_key)
    try:
        theirs.files.write("/home/user/signed.txt", "theirs")
        url = sandbox.download_url("/home/user/signed.txt")
        assert url.startswith(e2b.url) and "signature=v1_" in url, url
        got = httpx.get(url, timeout=60)  # no header, no key: the signature alone
        assert got.status_code == 200 and got.text == "mine", (got.status_code, got.text)
        assert httpx.get(theirs.download_url("/home/user/signed.txt"), timeout=60).text == "theirs"
        other_path = url.replace("signed.txt", "other.txt")
        assert httpx.get(other_path, timeout=60).status_code == 401  # the path is signed
        up = httpx.post(
            sandbox.upload_url("/home/user/up.txt"), files={"file": ("up.txt", b"sent")}, timeout=60
        )
        assert up.status_code == 200 and sandbox.files.read("/home/user/up.txt") == "sent", up.text
        assert httpx.post(url, files={"file": ("x", b"x")}, timeout=60).status_code == 401  # read only
        short = sandbox.download_url("/home/user/signed.txt", use_signature_expiration=1)
        time.sleep(2.5)
        expired = httpx.get(short, timeout=60)
        assert expired.status_code == 401 and "expired" in expired.text
    finally:
        theirs.kill()
    assert httpx.get(url, timeout=60).status_code == 200  # its sandbox runs on
    sandbox.kill()
    assert httpx.get(url, timeout=60).status_code == 401  # and dies with it


# == the interpreter ==============================================================================


def test_13_a_string_result_loses_one_pair_of_quotes(sandbox: Any) -> None:
    sandbox.run_code("import os; os.environ['X'] = 'value'")
    assert sandbox.run_code("os.getenv('X')").text == "value"
    assert sandbox.run_code('"it\'s"').text == '"it\'s"'  # a double-quoted repr is left alone
    assert sandbox.run_code("6 * 7").text == "42"


# == ports: get_host ==============================================================================

ECHO_SERVER = """
import tornado.ioloop, tornado.web, tornado.websocket

class Echo(tornado.websocket.WebSocketHandler):
    def on_message(self, message):
        self.write_message("echo:" + message)

class Upload(tornado.web.RequestHandler):
    def post(self):
        self.write({"bytes": len(self.request.body), "type": self.request.headers.get("Content-Type")})

tornado.web.Application([(r"/ws", Echo), (r"/upload", Upload)]).listen(8765)
tornado.ioloop.IOLoop.current().start()
"""


def _through_host(svc: Service, host: str, path: str = "/", **headers: str) -> httpx.Response:
    return httpx.get(f"{svc.url}{path}", headers={"Host": host, **headers}, timeout=60)


def test_12_get_host_reaches_a_web_server_in_the_sandbox_by_its_host_name(e2b: Service, sandbox: Any) -> None:
    """``python -m http.server`` started in the background answers at ``get_host(8000)``, with
    the sandbox's traffic token; without it, with another sandbox's, or with another key, the
    same 404; a port nothing listens on is a 502 that says so."""
    from e2b_code_interpreter import Sandbox

    sandbox.files.write("/tmp/site/index.html", "<h1>from the sandbox</h1>")
    sandbox.commands.run("cd /tmp/site && python -m http.server 8000", background=True)
    host = sandbox.get_host(8000)
    assert host == f"8000-{sandbox.sandbox_id}.{DOMAIN}", host
    token = {"E2B-Traffic-Access-Token": sandbox.traffic_access_token}
    _until(lambda: _through_host(e2b, host, **token).status_code == 200, 60, "the server answering")
    page = _through_host(e2b, host, "/index.html?x=1", **token)
    assert page.text == "<h1>from the sandbox</h1>" and page.headers["content-type"] == "text/html"
    listing = httpx.request("HEAD", f"{e2b.url}/", headers={"Host": host, **token}, timeout=60)
    assert listing.status_code == 200  # any method, any path
    owner = _through_host(e2b, host, Authorization=f"Bearer {e2b.api_key}")
    assert owner.status_code == 200, owner.text  # the owner's API key works too
    other = Sandbox.create()
    try:
        refused = [
            _through_host(e2b, host),
            _through_host(e2b, host, **{"E2B-Traffic-Access-Token": other.traffic_access_token}),
            _through_host(e2b, host, Authorization=f"Bearer {e2b.other_key}"),
        ]
    finally:
        other.kill()
    assert [r.status_code for r in refused] == [404, 404, 404], [r.text for r in refused]
    assert len({r.text for r in refused}) == 1  # the same answer: nothing says which it was
    closed = _through_host(e2b, sandbox.get_host(8001), **token)
    assert closed.status_code == 502 and "port 8001" in closed.json()["error"]["message"], closed.text


def test_12_get_host_carries_a_websocket_to_a_server_in_the_sandbox(e2b: Service, sandbox: Any) -> None:
    import asyncio

    import aiohttp

    sandbox.files.write("/tmp/echo.py", ECHO_SERVER)
    sandbox.commands.run("python /tmp/echo.py", background=True)
    headers = {"Host": sandbox.get_host(8765), "E2B-Traffic-Access-Token": sandbox.traffic_access_token}

    async def talk() -> list[str]:
        async with aiohttp.ClientSession() as http:
            deadline = time.monotonic() + 60
            while True:  # until the server listens
                try:
                    ws = await http.ws_connect(f"{e2b.url}/ws", headers=headers)
                    break
                except aiohttp.WSServerHandshakeError:
                    assert time.monotonic() < deadline, "the WebSocket server never answered"
                    await asyncio.sleep(0.5)
            async with ws:
                got = []
                for text in ("one", "two" * 50000):
                    await ws.send_str(text)
                    got.append((await ws.receive(timeout=30)).data)
                return got

    assert asyncio.run(talk()) == ["echo:one", "echo:" + "two" * 50000]
    # a body larger than the service takes for its own API (max_code_bytes + 1 MiB) is streamed
    body = b"x" * (6 << 20)
    up = httpx.post(
        f"{e2b.url}/upload",
        content=body,
        headers={**headers, "Content-Type": "application/x-kh"},
        timeout=120,
    )
    assert up.status_code == 200 and up.json() == {"bytes": len(body), "type": "application/x-kh"}, up.text


# == the environment ==============================================================================


def test_17_the_commands_of_e2bs_images_are_there(sandbox: Any) -> None:
    """Programs and models' scripts written for E2B run ``python``, ``git``, ``curl``, ``sudo``."""
    result = sandbox.commands.run(
        "python -c 'import sys; print(sys.version_info[0])' && git --version && curl --version "
        "| head -1 && sudo -n true && echo sudo-ok"
    )
    lines = result.stdout.splitlines()
    assert lines[0] == "3" and lines[1].startswith("git version") and lines[2].startswith("curl ")
    assert lines[-1] == "sudo-ok", result.stdout


def test_17_code_interpreter_has_e2bs_data_stack_and_base_not(e2b: Service, sandbox: Any) -> None:
    """``code-interpreter-v1`` (the code interpreter SDK's default) starts our data-science
    built-in, as E2B's image has the data stack; ``base`` (the bare SDK's) the minimal one."""
    from e2b import CommandExitException
    from e2b import Sandbox as BaseSandbox

    stack = "pandas, numpy, matplotlib, PIL, scipy, sklearn, seaborn, openpyxl"
    result = sandbox.run_code(f"import {stack}\nlen([{stack}])")
    assert result.error is None and result.text == "8", (result.error, result.text)
    assert sandbox.get_info().template_id == "python-datasci"
    base = BaseSandbox.create()
    try:
        assert base.get_info().template_id == "python"
        with pytest.raises(CommandExitException) as refused:
            base.commands.run("python -c 'import pandas'")
    finally:
        base.kill()
    assert "No module named 'pandas'" in refused.value.stderr, refused.value


CHART_AND_FRAME = """
import matplotlib.pyplot as plt
import pandas as pd
fig, ax = plt.subplots()
ax.plot([1, 2, 3], [4, 5, 6], label="rise")
ax.set_title("Rise")
ax.set_xlabel("time (s)")
plt.show()
pd.DataFrame({"a": [1, 2], "b": ["x", None], "c": [0.5, float("nan")]})
"""


def test_14_a_figure_is_a_chart_a_frame_is_data_and_a_saved_pil_image_shows(sandbox: Any) -> None:
    """E2B's interpreter: a matplotlib figure carries its chart (``e2b/chart``), a DataFrame its
    columns (``e2b/data``), and a PIL image saved to a file is displayed."""
    from e2b_code_interpreter.charts import ChartType, LineChart

    execution = sandbox.run_code(CHART_AND_FRAME)
    assert execution.error is None, execution.error
    figure, frame = execution.results
    assert figure.png and isinstance(figure.chart, LineChart), figure.formats()
    chart = figure.chart
    assert (chart.type, chart.title, chart.x_label, chart.x_unit) == (ChartType.LINE, "Rise", "time (s)", "s")
    assert [(e.label, [tuple(p) for p in e.points]) for e in chart.elements] == [
        ("rise", [(1.0, 4.0), (2.0, 5.0), (3.0, 6.0)])
    ]
    assert (
        frame.is_main_result
        and frame.html
        and frame.data == {"a": [1, 2], "b": ["x", None], "c": [0.5, None]}
    )
    saved = sandbox.run_code("from PIL import Image\nImage.new('RGB', (4, 4), 'red').save('/tmp/red.png')")
    assert saved.error is None and len(saved.results) == 1 and saved.results[0].png, saved.results
    assert sandbox.files.read("/tmp/red.png", format="bytes")[:4] == b"\x89PNG"
