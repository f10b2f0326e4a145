"""E2B's own SDKs (``e2b`` and ``e2b-code-interpreter`` from the package registry, unmodified)
against the service's E2B surface, through real VMs: ``E2B_API_URL=<service>/e2b``,
``E2B_SANDBOX_URL=<service>/e2b/sandbox`` and ``E2B_API_KEY=<key>`` are the whole
configuration."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from ...harness import Service
from .conftest import SHOW_PNG, e2b_env

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

HERE = Path(__file__).resolve().parent


@pytest.fixture
async def sandbox(e2b: Service) -> AsyncIterator[object]:
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create(metadata={"suite": "e2b"}, envs={"GREETING": "hi there"})
    try:
        yield sbx
    finally:
        await sbx.kill()


def test_an_unmodified_e2b_program_runs(agents_service: Service) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_")}
    done = subprocess.run(
        [sys.executable, str(HERE / "e2b_program.py")],
        env={**env, **e2b_env(agents_service)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["text"] == "42" and seen["stdout"] == ["hello\n"], seen
    assert seen["read"] == "written by E2B code"
    assert seen["command"] == "19\n/home/user\n" and seen["exit_code"] == 0, seen
    assert seen["running"] is True
    # the program's `with` block killed its sandbox
    from kernelhost import Sandbox

    assert seen["id"] not in [
        s.id for s in Sandbox.list(url=agents_service.url, api_key=agents_service.api_key)
    ]


async def test_code_streams_rich_results_and_errors(sandbox: object) -> None:
    from e2b_code_interpreter import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    seen: list[str] = []
    ex = await sandbox.run_code(
        "import os, time\nfor i in range(3):\n    print('tick', i, flush=True)\nos.environ['GREETING']",
        on_stdout=lambda m: seen.append(m.line),
    )
    assert ex.error is None and ex.text == "hi there", ex
    assert "".join(seen) == "tick 0\ntick 1\ntick 2\n" and ex.execution_count is not None
    shown = await sandbox.run_code(SHOW_PNG)
    assert shown.results and base64.b64decode(shown.results[0].png or "")[:4] == b"\x89PNG", shown.results
    failed = await sandbox.run_code("1/0")
    assert failed.error is not None and failed.error.name == "ZeroDivisionError"
    assert "ZeroDivisionError" in failed.error.traceback
    per_call = await sandbox.run_code("import os; os.environ.get('ONLY_NOW')", envs={"ONLY_NOW": "yes"})
    after = await sandbox.run_code("import os; os.environ.get('ONLY_NOW')")
    assert (per_call.text, after.text) == ("yes", None), (per_call, after)
    shell = await sandbox.run_code("echo $GREETING from bash", language="bash")
    assert shell.logs.stdout == ["hi there from bash\n"], shell


async def test_files_and_commands(sandbox: object) -> None:
    from e2b import CommandExitException
    from e2b_code_interpreter import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    info = await sandbox.files.write("notes/a.txt", "alpha")
    assert info.path == "/home/user/notes/a.txt", info
    assert await sandbox.files.read("notes/a.txt") == "alpha"
    assert await sandbox.files.make_dir("/home/user/made") is True
    assert await sandbox.files.make_dir("/home/user/made") is False
    names = {e.name for e in await sandbox.files.list("/home/user")}
    assert {"notes", "made"} <= names, names
    moved = await sandbox.files.rename("/home/user/notes/a.txt", "/home/user/made/b.txt")
    assert moved.path == "/home/user/made/b.txt"
    assert await sandbox.files.exists("/home/user/notes/a.txt") is False
    await sandbox.files.remove("/home/user/made")
    assert await sandbox.files.exists("/home/user/made") is False
    out: list[str] = []
    run = await sandbox.commands.run(
        "pwd; echo $COLOR; echo oops >&2", cwd="/tmp", envs={"COLOR": "teal"}, on_stdout=out.append
    )
    assert (run.stdout, run.stderr, run.exit_code) == ("/tmp\nteal\n", "oops\n", 0), run
    assert "".join(out) == "/tmp\nteal\n"
    with pytest.raises(CommandExitException) as failed:
        await sandbox.commands.run("echo partial; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "partial\n"
    # a command's cd and exports end with it, as an E2B process's do
    assert (await sandbox.commands.run("cd /; export X=1; pwd")).stdout == "/\n"
    assert (await sandbox.commands.run("pwd; echo ${X:-unset}")).stdout == "/home/user\nunset\n"


async def test_watch_dir_sees_files_come_change_and_go(sandbox: object) -> None:
    from e2b import FilesystemEventType
    from e2b_code_interpreter import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    await sandbox.files.make_dir("/home/user/watched/deep")
    seen: list[tuple[str, FilesystemEventType]] = []
    handle = await sandbox.files.watch_dir(
        "/home/user/watched", on_event=lambda e: seen.append((e.name, e.type)), recursive=True, timeout=300
    )
    try:
        await sandbox.files.write("/home/user/watched/deep/new.txt", "first")
        await _until(lambda: ("deep/new.txt", FilesystemEventType.CREATE) in seen, 60, "the create")
        await sandbox.files.write("/home/user/watched/deep/new.txt", "second, longer")
        await _until(lambda: seen.count(("deep/new.txt", FilesystemEventType.WRITE)) >= 2, 60, "the write")
        await sandbox.files.remove("/home/user/watched/deep/new.txt")
        await _until(lambda: ("deep/new.txt", FilesystemEventType.REMOVE) in seen, 60, "the remove")
    finally:
        await handle.stop()
    with pytest.raises(Exception, match=r"no-such-dir is not a directory"):
        await sandbox.files.watch_dir("/home/user/no-such-dir", on_event=seen.append)


async def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"{what} did not happen within {timeout}s"
        await asyncio.sleep(0.05)


async def test_background_commands_run_beside_code_take_input_and_are_followed(sandbox: object) -> None:
    """commands.run(background, stdin), send_stdin, close_stdin, connect, list, kill; a server
    reached by run_code while it runs; get_metrics; a fork's child without its parent's."""
    from e2b_code_interpreter import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    lines: list[str] = []
    echo = await sandbox.commands.run(
        'while read -r line; do echo "echo: $line"; done; echo bye',
        background=True,
        stdin=True,
        on_stdout=lines.append,
        timeout=300,
    )
    # code runs while the command waits for its input: it does not hold the sandbox
    assert (await sandbox.run_code("6 * 7")).text == "42"
    await sandbox.commands.send_stdin(echo.pid, "hello\n")
    await _until(lambda: "echo: hello\n" in "".join(lines), 60, "the command's answer")
    assert [p.pid for p in await sandbox.commands.list()] == [echo.pid]
    # a second client follows it from now on (commands.connect)
    follower = await sandbox.commands.connect(echo.pid, timeout=300)
    await sandbox.commands.send_stdin(echo.pid, "again\n")
    await sandbox.commands.close_stdin(echo.pid)  # end of file: the loop ends
    done = await echo.wait()
    assert (done.exit_code, done.stdout) == (0, "echo: hello\necho: again\nbye\n"), done
    followed = await follower.wait()
    assert followed.stdout.endswith("echo: again\nbye\n") and "hello" not in followed.stdout, followed
    assert await sandbox.commands.list() == []
    assert await sandbox.commands.kill(echo.pid) is False  # it ended: nothing to kill

    # a server in the background, reached by the sandbox's code while it runs, then killed
    server = await sandbox.commands.run(
        "cd /tmp && echo served > page.txt && exec python3 -m http.server 8765 --bind 127.0.0.1",
        background=True,
        timeout=300,
    )
    fetched = await sandbox.run_code(
        "import time, urllib.request\n"
        "for _ in range(200):\n"
        "    try:\n"
        "        body = urllib.request.urlopen('http://127.0.0.1:8765/page.txt', timeout=5).read()\n"
        "        break\n"
        "    except OSError:\n"
        "        time.sleep(0.1)\n"
        "body.decode().strip()",
        request_timeout=120,
    )
    assert fetched.error is None and fetched.text == "served", (fetched.error, fetched.text)
    # get_metrics: the samples so far (or, before the first, a reading of now, whose probe does
    # not show as a command)
    readings = await sandbox.get_metrics()
    assert readings, readings
    reading = readings[-1]
    assert reading.cpu_count >= 1 and 0 <= reading.cpu_used_pct <= 100, reading
    assert 0 < reading.mem_used < reading.mem_total and 0 <= reading.disk_used <= reading.disk_total, reading
    assert [p.pid for p in await sandbox.commands.list()] == [server.pid]
    # a fork's child does not inherit it: the copy in the child's VM is ended, not left unlisted
    (child,) = await sandbox.fork(count=1)
    assert isinstance(child, AsyncSandbox)
    try:
        assert await child.commands.list() == []
        gone = await child.run_code(
            "import os, time\n"
            "def serving():\n"
            "    found = []\n"
            "    for p in filter(str.isdigit, os.listdir('/proc')):\n"
            "        try:\n"
            "            if b'http.server' in open(f'/proc/{p}/cmdline', 'rb').read():\n"
            "                found.append(p)\n"
            "        except OSError:\n"
            "            pass\n"
            "    return found\n"
            "for _ in range(100):\n"
            "    if not serving():\n"
            "        break\n"
            "    time.sleep(0.1)\n"
            "serving()",
            request_timeout=120,
        )
        assert gone.text == "[]", (gone.error, gone.text)
    finally:
        await child.kill()
    assert [p.pid for p in await sandbox.commands.list()] == [server.pid]
    assert await server.kill() is True
    with pytest.raises(Exception):  # noqa: B017  (killed: an exit code that is not 0)
        await server.wait()
    assert await sandbox.commands.list() == []


async def test_lifecycle_list_timeout_pause_and_connect(e2b: Service) -> None:
    from e2b import SandboxQuery
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create(timeout=120, metadata={"run": "lifecycle"})
    try:
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata={"run": "lifecycle"})).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id], listed
        info = await sbx.get_info()
        assert info.metadata == {"run": "lifecycle"} and info.template_id == "python-datasci", info
        await sbx.set_timeout(900)
        assert (await sbx.get_info()).end_at > info.end_at
        await sbx.run_code("kept = [1, 2, 3]")
        await sbx.pause()
        paused = await AsyncSandbox.list(query=SandboxQuery(metadata={"run": "lifecycle"})).next_items()
        assert [s.state.value for s in paused] == ["paused"], paused
        again = await AsyncSandbox.connect(sbx.sandbox_id)
        assert (await again.run_code("sum(kept)")).text == "6"
        with pytest.raises(SandboxException, match="volume"):
            await AsyncSandbox.create(volume_mounts={"/data": "vol"})
    finally:
        assert await sbx.kill() is True
    assert await AsyncSandbox.kill(sbx.sandbox_id) is False


async def test_another_key_and_a_forged_token_are_refused(e2b: Service, sandbox: object) -> None:
    import aiohttp
    from e2b.exceptions import SandboxNotFoundException
    from e2b_code_interpreter import AsyncSandbox

    assert isinstance(sandbox, AsyncSandbox)
    with pytest.raises(SandboxNotFoundException):
        await AsyncSandbox.connect(sandbox.sandbox_id, api_key=e2b.other_key)
    theirs = await AsyncSandbox.list(api_key=e2b.other_key).next_items()
    assert sandbox.sandbox_id not in [s.sandbox_id for s in theirs]
    assert await AsyncSandbox.kill(sandbox.sandbox_id, api_key=e2b.other_key) is False
    assert (await sandbox.run_code("1 + 1")).text == "2"  # still there, still its owner's
    headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    async with aiohttp.ClientSession() as http:
        for token in ("", "kh_" + "0" * 40):
            async with http.get(
                f"{e2b.url}/e2b/sandbox/files", params={"path": "/etc/hostname"},
                headers={**headers, "X-Access-Token": token},
            ) as r:  # fmt: skip
                # the same 404 an unknown sandbox gets: no existence oracle (issue 35)
                assert r.status == 404 and "envdAccessToken" in (await r.json())["message"]
        async with http.post(f"{e2b.url}/e2b/v2/sandboxes", json={}, headers={"X-API-KEY": "wrong"}) as r:
            assert r.status == 401 and (await r.json())["code"] == 401


async def test_datasci_results_a_timeout_and_a_background_command(e2b: Service) -> None:
    from e2b import TimeoutException
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create(template="python-datasci")
    try:
        plot = await sbx.run_code(
            "import matplotlib.pyplot as plt, pandas as pd\n"
            "plt.plot([1, 2, 3], [1, 4, 9]); plt.show()\n"
            "pd.DataFrame({'a': [1, 2], 'b': [3, 4]})"
        )
        assert plot.error is None, plot.error
        assert any(r.png for r in plot.results), [r.formats() for r in plot.results]
        assert "<table" in (plot.results[-1].html or ""), plot.results[-1].formats()
        # the SDK's timeout ends the request; the service interrupts the code and the kernel lives on
        with pytest.raises(TimeoutException):
            await sbx.run_code("import time; kept = 7; time.sleep(60)", timeout=3)
        assert (await sbx.run_code("kept * 6", request_timeout=120)).text == "42"
        handle = await sbx.commands.run("echo started; sleep 120", background=True)
        assert handle.pid > 0
        assert [p.pid for p in await sbx.commands.list()] == [handle.pid]
        assert await sbx.commands.kill(handle.pid) is True
        with pytest.raises(Exception):  # noqa: B017  (killed: an exit code that is not 0)
            await handle.wait()
        children = await sbx.fork(count=2)
        assert all(isinstance(c, AsyncSandbox) for c in children), children
        try:
            for child in children:
                assert isinstance(child, AsyncSandbox)
                assert (await child.run_code("kept")).text == "7"
        finally:
            for child in children:
                if isinstance(child, AsyncSandbox):
                    await child.kill()
    finally:
        await sbx.kill()


async def test_a_snapshot_outlives_its_sandbox_and_starts_new_ones(e2b: Service) -> None:
    from e2b.exceptions import SandboxException
    from e2b_code_interpreter import AsyncSandbox

    sbx = await AsyncSandbox.create(metadata={"run": "snapshot"})
    taken: list[str] = []
    try:
        await sbx.run_code("kept = {'answer': 42}")
        await sbx.files.write("/home/user/snap.txt", "in the snapshot")
        snap = await sbx.create_snapshot()
        taken.append(snap.snapshot_id)
        assert snap.snapshot_id.startswith("cp_") and snap.names == [], snap
        named = await sbx.create_snapshot(name="e2b-suite-snap")
        taken.append(named.snapshot_id)
        assert (named.snapshot_id, named.names) == ("e2b-suite-snap", ["e2b-suite-snap"]), named
        with pytest.raises(SandboxException, match="filesystem"):
            await sbx.create_snapshot(mode="filesystem")
        own = await sbx.list_snapshots().next_items()
        assert [s.snapshot_id for s in own] == taken, own
        assert await sbx.kill() is True

        new = await AsyncSandbox.create(snap.snapshot_id)
        try:
            assert (await new.run_code("kept['answer']")).text == "42"
            assert await new.files.read("/home/user/snap.txt") == "in the snapshot"
            assert (await new.get_info()).metadata["branched_from"] == snap.snapshot_id
        finally:
            await new.kill()

        listed = await AsyncSandbox.list_snapshots().next_items()
        assert {snap.snapshot_id, "e2b-suite-snap"} <= {s.snapshot_id for s in listed}, listed
        by_name = await AsyncSandbox.list_snapshots(name="e2b-suite-snap").next_items()
        assert [s.names for s in by_name] == [["e2b-suite-snap"]]
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is True
        assert await AsyncSandbox.delete_snapshot(snap.snapshot_id) is False
        left = {s.snapshot_id for s in await AsyncSandbox.list_snapshots().next_items()}
        assert snap.snapshot_id not in left and "e2b-suite-snap" in left
        with pytest.raises(SandboxException):  # another key sees none of them
            await AsyncSandbox.create("e2b-suite-snap", api_key=e2b.other_key)
    finally:
        await sbx.kill()
        for snapshot_id in taken:  # their pins would keep the shared template snapshot
            await AsyncSandbox.delete_snapshot(snapshot_id)
