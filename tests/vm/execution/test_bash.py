"""Bash through a real VM: streaming, exit codes, cwd and exports kept, empty stdin."""

from __future__ import annotations

import time

import pytest

from kernelhost import AsyncSandbox

pytestmark = pytest.mark.vm


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
