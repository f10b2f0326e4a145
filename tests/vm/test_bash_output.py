"""Bash output through the service on real VMs, as an agent with ``raw_output`` sends it: the
command's bytes spliced from its pipes to the port, decoded by the host into the same stream
events as before. The hostile side of these frames is in ``test_hostile_guest.py``."""

from __future__ import annotations

import pytest

from kernelhost import AsyncSandbox

pytestmark = pytest.mark.vm

MARKER = "[kernelhost: output truncated"


async def test_a_large_output_arrives_whole_and_in_order(sandbox: AsyncSandbox) -> None:
    ex = await sandbox.run_code("seq 1 400000; echo done >&2", language="bash", timeout=300)
    assert ex.stdout == "".join(f"{i}\n" for i in range(1, 400001))
    assert ex.stderr == "done\n"
    assert ex.exit_code == 0 and not ex.output_truncated


async def test_a_character_split_between_frames_is_made_whole(sandbox: AsyncSandbox) -> None:
    # the pauses make each part its own frame: the host's decoder joins the character's bytes
    code = r"printf 'caf\xc3'; sleep 0.3; printf '\xa9 \xe2\x82'; sleep 0.3; printf '\xac!\xff\n'"
    ex = await sandbox.run_code(code, language="bash", timeout=60)
    assert ex.stdout == "café €!\ufffd\n"
    ex = await sandbox.run_code(r"printf 'end \xe2\x82'", language="bash", timeout=60)
    assert ex.stdout == "end \ufffd"  # an incomplete character at the end: replaced


async def test_stdout_and_stderr_keep_their_order(sandbox: AsyncSandbox) -> None:
    events: list[tuple[str, str]] = []
    ex = await sandbox.run_code(
        "for i in 1 2 3; do echo out$i; sleep 0.2; echo err$i >&2; sleep 0.2; done",
        language="bash",
        timeout=60,
        on_stdout=lambda text: events.append(("stdout", text)),
        on_stderr=lambda text: events.append(("stderr", text)),
    )
    assert ex.stdout == "out1\nout2\nout3\n" and ex.stderr == "err1\nerr2\nerr3\n"
    # each line was written a pause apart from the next: the events come as they were written
    assert events == [
        (name, f"{kind}{i}\n") for i in (1, 2, 3) for name, kind in (("stdout", "out"), ("stderr", "err"))
    ]


async def test_output_over_the_cap_is_cut_with_a_marker_and_the_command_runs_on(
    sandbox: AsyncSandbox,
) -> None:
    # 24 MB against the service's 4 MiB: the agent drains the rest without sending it
    ex = await sandbox.run_code(
        "head -c 24000000 /dev/zero | tr '\\0' x; echo after >&2; exit 5", language="bash", timeout=300
    )
    assert ex.output_truncated and MARKER in ex.stdout + ex.stderr
    assert ex.exit_code == 5  # it ran to its end: past the cap, bash never blocked
    assert len((ex.stdout + ex.stderr).encode()) < (4 << 20) + 1000
    assert (await sandbox.run_code("echo fine", language="bash", timeout=60)).stdout == "fine\n"


async def test_commands_run_in_the_static_bash_that_calls_itself_bash(sandbox: AsyncSandbox) -> None:
    """The image's statically linked bash (Debian's bash-static) runs each command: under
    emulation it starts in a fifth of the dynamic one's time, which a command run right after
    another waited for. The command still sees bash: $BASH, $0 and the version."""
    ex = await sandbox.run_code(
        'readlink /proc/$$/exe; echo "$BASH $0 ${BASH_VERSINFO[0]}"', language="bash", timeout=60
    )
    exe, names = ex.stdout.splitlines()
    assert exe.endswith("/bash-static"), ex.stdout
    assert names == "/bin/bash bash 5", ex.stdout
