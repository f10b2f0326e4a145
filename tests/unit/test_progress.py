"""Progress of image and snapshot builds (kernelhost/progress.py): a bar with stage n/N and the
elapsed time on a terminal, plain lines (or structured events) elsewhere."""

from __future__ import annotations

import importlib.util
import io
import sys
from pathlib import Path
from typing import Any

import pytest

from kernelhost.progress import Stages, TerminalAware

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_on_a_terminal_the_bar_shows_stage_n_of_n_and_the_time() -> None:
    term, clock = Terminal(), Clock()
    with Stages(
        "snapshot python",
        ["boot", "kernel ready", "warm-up", "freeze"],
        stream=term,
        tick=0,
        clock=clock,
        width=8,
    ) as bar:
        bar.stage("boot", "512 MiB")
        assert bar.render() == "[snapshot python] ░░░░░░░░ 1/4 boot (512 MiB) 0:00"
        clock.now += 65
        bar.stage("warm-up")
        assert bar.render() == "[snapshot python] ████░░░░ 3/4 warm-up 1:05"
        bar.echo("a log line")
    screen = term.getvalue()
    # drawn in place: each redraw erases the line first; echoed text goes above the bar
    assert screen.count("\r\x1b[K") >= 2
    assert "\r\x1b[Ka log line\n[snapshot python] ████░░░░ 3/4 warm-up 1:05" in screen
    assert screen.endswith("[snapshot python] ████████ 4/4 done 1:05\n")


def test_without_a_terminal_each_stage_is_one_plain_line() -> None:
    out, clock = io.StringIO(), Clock()
    with Stages("image python", ["rootfs", "kernel", "erofs"], stream=out, clock=clock) as bar:
        bar.stage("rootfs", "mmdebstrap")
        clock.now += 42
        bar.stage("erofs")
    assert out.getvalue().splitlines() == [
        "image python: [1/3] rootfs: mmdebstrap",
        "image python: [3/3] erofs",
        "image python: done in 42.0 s",
    ]
    assert "\r" not in out.getvalue() and "█" not in out.getvalue()


def test_lines_and_events_go_to_callbacks_and_a_failure_is_reported() -> None:
    lines: list[str] = []
    events: list[tuple[int, int, str, str, float]] = []
    with pytest.raises(RuntimeError):
        with Stages(
            "snapshot python",
            ["boot", "freeze"],
            tty=False,
            on_line=lines.append,
            on_stage=lambda *e: events.append(e),
        ) as bar:
            bar.stage("boot")
            raise RuntimeError("no kernel")
    assert lines[0] == "snapshot python: [1/2] boot"
    assert lines[1].startswith("snapshot python: failed in ") and "RuntimeError: no kernel" in lines[1]
    assert [(n, total, stage) for n, total, stage, _, _ in events] == [(1, 2, "boot"), (1, 2, "failed")]


def test_log_lines_written_through_terminal_aware_go_above_the_bar() -> None:
    term = Terminal()
    logs = TerminalAware(term)
    bar = Stages("image python", ["rootfs", "kernel"], stream=term, tick=0)
    bar.stage("rootfs")
    logs.write("event one")
    logs.write("\n")
    bar.finish()
    screen = term.getvalue()
    assert "\r\x1b[Kevent one\n[image python]" in screen
    assert logs.isatty()


def test_build_script_reports_its_stages_through_the_bar(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("_build", REPO / "guest-image" / "build.py")
    assert spec is not None and spec.loader is not None
    build: Any = importlib.util.module_from_spec(spec)  # loaded by path: its _BAR is set below
    spec.loader.exec_module(build)
    progress = build._progress_module()
    assert progress is not None and progress.Stages.__name__ == "Stages"
    build.stage("rootfs", "before any bar")  # no bar: a plain log line
    build._BAR = progress.Stages(
        "image python", build.STAGES, stream=sys.stdout, tty=False, on_line=lambda line: print(line)
    )
    build.stage("kernel", "linux-image-cloud-amd64")
    build.log("kernel: 6.1.0")
    assert build.run(["true"]).returncode == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("] rootfs: before any bar")
    assert lines[1] == "image python: [2/7] kernel: linux-image-cloud-amd64"
    assert lines[2].endswith("] kernel: 6.1.0")
