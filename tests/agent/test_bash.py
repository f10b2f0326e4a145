"""Shell commands (ops bash, bash_signal, bash_reset) without cgroups, as on a developer's host."""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kernelhost_agent import bashstandby

from kernelhost.channel import protocol

from .conftest import Running
from .host import WAIT, HostEnd

pytestmark = pytest.mark.unit


@dataclass
class BashRun:
    run_id: str
    pid: int
    streams: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    reply: dict[str, Any] = field(default_factory=dict)


async def start(host: HostEnd, command: str, **fields: Any) -> BashRun:
    run_id = uuid.uuid4().hex
    host.sent_parents.add(run_id)
    reply = await host.ok(protocol.Op.BASH, run_id=run_id, command=command, **fields)
    return BashRun(run_id, reply["pid"])


async def finish(host: HostEnd, run: BashRun, timeout: float = WAIT) -> BashRun:
    """Collect the run's stream messages up to its bash_reply."""
    while not run.reply:
        channel, msg = await host.next_message(run.run_id, timeout)
        assert msg["parent_header"] == {"msg_id": run.run_id, "msg_type": "bash_request"}
        assert msg["header"]["session"] == "bash"
        assert msg["header"]["version"] == protocol.JUPYTER_PROTOCOL_VERSION
        if msg["header"]["msg_type"] == "stream":
            assert channel == "iopub"
            run.streams[msg["content"]["name"]] += msg["content"]["text"]
        else:
            assert (channel, msg["header"]["msg_type"]) == ("shell", "bash_reply")
            run.reply = msg["content"]
    return run


async def bash(host: HostEnd, command: str, **fields: Any) -> BashRun:
    return await finish(host, await start(host, command, **fields))


async def test_streams_and_exit_code(host: HostEnd) -> None:
    run = await bash(host, "echo out; echo err >&2; exit 3")
    assert run.streams == {"stdout": "out\n", "stderr": "err\n"}
    assert run.reply["exit_code"] == 3
    assert run.reply["signal"] is None and run.reply["failure"] is None
    assert run.reply["cpu_ms"] >= 0
    assert run.reply["peak_memory_bytes"] is None  # no cgroup here


async def test_errors_read_like_bash(host: HostEnd) -> None:
    run = await bash(host, "no-such-command-kh")
    assert run.reply["exit_code"] == 127
    assert "no-such-command-kh: command not found" in run.streams["stderr"]


async def test_cwd_and_exports_persist_between_calls(host: HostEnd, running: Running) -> None:
    await bash(host, "mkdir -p sub && cd sub && export KH_FOO=bar && KH_LOCAL=1")
    run = await bash(host, 'pwd; echo "$KH_FOO|${KH_LOCAL:-unset}"')
    assert run.streams["stdout"] == f"{running.config.kernel_cwd}/sub\nbar|unset\n"


async def test_reset_forgets_cwd_and_exports(host: HostEnd, running: Running) -> None:
    await bash(host, "cd / && export KH_RESET=1")
    assert await host.ok(protocol.Op.BASH_RESET)
    run = await bash(host, 'pwd; echo "${KH_RESET:-gone}"')
    assert run.streams["stdout"] == f"{running.config.kernel_cwd}\ngone\n"


async def test_output_is_capped(host: HostEnd) -> None:
    run = await bash(host, "head -c 100000 /dev/zero | tr '\\0' x; echo done >&2", max_output_bytes=5)
    assert run.streams["stdout"] + run.streams["stderr"] == "xxxxxx"  # the cap and one more
    assert run.reply["exit_code"] == 0


async def test_undecodable_output_is_replaced(host: HostEnd) -> None:
    run = await bash(host, r"printf 'a\377b'")
    assert run.streams["stdout"] == "a\ufffdb"


@pytest.mark.parametrize(("name", "signum"), [("INT", signal.SIGINT), ("KILL", signal.SIGKILL)])
async def test_signal_ends_a_command(host: HostEnd, name: str, signum: int) -> None:
    run = await start(host, "echo started; exec sleep 30")
    _, first = await host.next_message(run.run_id)  # "started": the sleep is next
    assert first["content"]["text"] == "started\n"
    reply = await host.ok(protocol.Op.BASH_SIGNAL, run_id=run.run_id, signal=name)
    assert reply["signalled"] == 1
    await finish(host, run)
    assert run.reply["signal"] == signum and run.reply["exit_code"] == 128 + signum


async def test_signal_to_every_command_and_to_none(host: HostEnd) -> None:
    runs = [await start(host, "exec sleep 30") for _ in range(2)]
    reply = await host.ok(protocol.Op.BASH_SIGNAL, run_id=None, signal="TERM")
    assert reply["signalled"] == 2
    for run in runs:
        assert (await finish(host, run)).reply["signal"] == signal.SIGTERM
    gone = await host.ok(protocol.Op.BASH_SIGNAL, run_id=runs[0].run_id, signal="TERM")
    assert gone["signalled"] == 0


async def test_reset_kills_running_commands(host: HostEnd) -> None:
    run = await start(host, "exec sleep 30")
    await host.ok(protocol.Op.BASH_RESET)
    assert (await finish(host, run)).reply["signal"] == signal.SIGKILL


async def test_a_run_id_cannot_run_twice(host: HostEnd) -> None:
    run = await start(host, "exec sleep 30")
    error = await host.refused(protocol.Op.BASH, run_id=run.run_id, command="true")
    assert "already running" in error
    await host.ok(protocol.Op.BASH_SIGNAL, run_id=run.run_id, signal="KILL")
    await finish(host, run)


async def test_a_background_job_does_not_hold_the_reply(host: HostEnd) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    run = await bash(host, "sleep 2 & echo fg")
    assert run.streams["stdout"] == "fg\n" and run.reply["exit_code"] == 0
    assert loop.time() - t0 < 1.5  # the pipes are drained for half a second, not waited on


async def test_scripts_and_state_files_are_removed(host: HostEnd, running: Running) -> None:
    await bash(host, "true")
    await bash(host, "true")  # the second runs on the standby the first left
    left = os.listdir(running.config.bash_dir)  # only the next standby's FIFO (its go), if any
    assert len(left) <= 1 and all(name.endswith(".go") for name in left), left


async def test_a_command_reads_what_is_written_to_its_stdin(host: HostEnd) -> None:
    caps = (await host.ok(protocol.Op.HELLO))["capabilities"]
    assert protocol.Capability.PROCESSES in caps
    run = await start(host, 'while read -r line; do echo "got $line"; done; echo eof', stdin=True)
    await host.ok(protocol.Op.BASH_INPUT, run_id=run.run_id, data=b"one\ntw")
    await host.ok(protocol.Op.BASH_INPUT, run_id=run.run_id, data=b"o\n", eof=True)
    run = await finish(host, run)
    assert run.streams["stdout"] == "got one\ngot two\neof\n"
    assert run.reply["exit_code"] == 0


async def test_input_to_a_command_without_stdin_or_ended_is_refused(host: HostEnd) -> None:
    run = await start(host, "sleep 30")
    reply = await host.request(protocol.Op.BASH_INPUT, run_id=run.run_id, data=b"x")
    assert not reply["ok"] and "has no stdin open" in reply["error"]
    await host.ok(protocol.Op.BASH_SIGNAL, run_id=run.run_id, signal="KILL")
    await finish(host, run)
    reply = await host.request(protocol.Op.BASH_INPUT, run_id=run.run_id, data=b"x")
    assert not reply["ok"] and "is running" in reply["error"]
    # without stdin, a command that reads gets end of file at once
    assert (await bash(host, "cat; echo done")).streams["stdout"] == "done\n"


async def test_a_command_that_keeps_no_state_leaves_the_shell_as_it_was(
    host: HostEnd, running: Running
) -> None:
    await bash(host, "cd / && export KH_BG=no", keep_state=False)
    run = await bash(host, 'pwd; echo "${KH_BG:-unset}"')
    assert run.streams["stdout"] == f"{running.config.kernel_cwd}\nunset\n"


async def test_a_state_cut_short_is_not_taken(host: HostEnd, running: Running) -> None:
    await bash(host, "export KH_WHOLE=1")
    area = running.agent.bash
    before = (dict(area.env or {}), area.cwd)
    path = Path(running.config.bash_dir) / "partial.state"
    path.write_bytes(b"/\0KH_PARTIAL=1\0")  # its EXIT trap killed before it wrote the end
    area._load_state(str(path))
    path.unlink()
    assert (area.env, area.cwd) == before
    assert (await bash(host, 'echo "$KH_WHOLE${KH_PARTIAL:-}"')).streams["stdout"] == "1\n"


async def test_what_the_next_command_inherits(host: HostEnd) -> None:
    setup = (
        "export KH_A='two\nlines = and \"quotes\"' KH_EMPTY= KH_GONE=1 KH_UNEXP=1; export -n KH_UNEXP; "
        "unset KH_GONE; KH_LOCAL=1; export KH_ONLY_MARKED; declare -ax KH_ARR=(1 2)"
    )
    await bash(host, setup)
    check = (
        'printf "%s|" "$KH_A" "${KH_EMPTY-unset}" "${KH_GONE-unset}" "${KH_UNEXP-unset}" '
        '"${KH_LOCAL-unset}" "${KH_ONLY_MARKED-unset}" "${KH_ARR-unset}"'
    )
    run = await bash(host, check)
    assert run.streams["stdout"] == 'two\nlines = and "quotes"||unset|unset|unset|unset|unset|'


async def test_an_exported_function_is_inherited(host: HostEnd) -> None:
    await bash(host, "kh_greet() { echo hello from a function; }; export -f kh_greet; export KH_F=1")
    run = await bash(host, 'kh_greet; echo "$KH_F"')
    assert run.streams["stdout"] == "hello from a function\n1\n"
    await bash(host, "export -nf kh_greet")
    assert "kh_greet: command not found" in (await bash(host, "kh_greet")).streams["stderr"]


@pytest.mark.parametrize("options", ["set -x", "set -eu", "set -o pipefail -C; IFS=,"])
async def test_shell_options_neither_leak_nor_lose_the_state(host: HostEnd, options: str) -> None:
    run = await bash(host, f"{options}; export KH_OPT=kept; cd /")
    assert run.reply["exit_code"] == 0
    assert "__kh" not in run.streams["stderr"]  # the trap's own commands are not traced
    assert (await bash(host, 'echo "$KH_OPT $PWD"')).streams["stdout"] == "kept /\n"


async def test_a_command_runs_on_the_bash_started_ahead_with_the_state_left(running: Running) -> None:
    await bash(running.host, "cd /tmp && export KH_STANDBY=yes")
    standby = running.agent.bash._standby
    assert standby is not None  # started once the command ended, from the state it left
    run = await bash(running.host, 'echo "$PWD $KH_STANDBY"')
    assert run.pid == standby.proc.pid
    assert run.streams["stdout"] == "/tmp yes\n"


async def test_a_standby_that_died_or_no_longer_fits_is_replaced(running: Running) -> None:
    await bash(running.host, "true")
    standby = running.agent.bash._standby
    assert standby is not None
    os.kill(standby.proc.pid, signal.SIGKILL)  # a user's `pkill bash`
    os.waitid(os.P_PID, standby.proc.pid, os.WEXITED | os.WNOWAIT)  # noqa: ASYNC222 (SIGKILLed: returns at once)
    run = await bash(running.host, "echo still")
    assert run.pid != standby.proc.pid and run.streams["stdout"] == "still\n"
    stale = running.agent.bash._standby
    assert stale is not None
    running.agent.bash.env = {**(running.agent.bash.env or {}), "KH_CHANGED": "1"}  # as net_config does
    run = await bash(running.host, 'echo "$KH_CHANGED"')
    assert run.pid != stale.proc.pid and run.streams["stdout"] == "1\n"
    # killed, not left waiting: SIGKILL is sent at once, the exit follows (later on a busy host)
    for _ in range(int(WAIT / 0.01)):
        if not bashstandby.running(stale.proc.pid):
            break
        await asyncio.sleep(0.01)
    assert not bashstandby.running(stale.proc.pid)
