"""The runner of other projects' suites (tests/clients/suite_support.py) on a small suite of
its own: what its JUnit report says becomes the counts, with why each case failed, erred or was
skipped, and a deselected case is counted and its reason printed; a suite past its time limit
is killed with the processes it started."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.clients.suite_support import SUMMARY, run_pytest

pytestmark = pytest.mark.unit

SUITE = """
import pytest

def test_passes():
    assert True

def test_fails():
    assert 1 == 2, "one is not two"

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_left_out():
    raise AssertionError("deselected, never run")

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_errs(broken):
    pass
"""


def test_counts_come_from_the_report_with_every_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "test_theirs.py").write_text(SUITE)
    counts = run_pytest(
        sys.executable,
        ["test_theirs.py"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        report=tmp_path / "report.xml",
        deselect={"test_theirs.py::test_left_out": "cannot apply here"},
        timeout=120,
    )
    assert (counts.passed, counts.failed, counts.errors, counts.skipped, counts.deselected) == (1, 1, 1, 1, 1)
    assert "one is not two" in counts.problems["test_fails"]
    assert "fixture broke" in counts.problems["test_errs"]
    assert counts.skips == {"test_skipped": "not here"}
    line = counts.report("theirs")
    assert line.startswith("theirs: 1 passed, 1 failed, 1 errors, 1 skipped, 1 deselected in ")
    # the closing summary: the count line, then each case left out with its reason
    assert SUMMARY[-3:] == [
        line,
        "  deselected test_theirs.py::test_left_out: cannot apply here",
        "  skipped test_skipped: not here",
    ]
    del SUMMARY[-3:]  # not a real suite: out of the session's summary
    printed = capsys.readouterr().out
    assert "deselected test_theirs.py::test_left_out: cannot apply here" in printed
    assert "skipped test_skipped: not here" in printed


HANGS = """
import subprocess, sys, time

def test_hangs(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open("child.pid", "w").write(str(child.pid))
    time.sleep(600)
"""


def test_a_suite_past_its_limit_is_killed_with_every_process_it_started(tmp_path: Path) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    report = tmp_path / "report.xml"
    with pytest.raises(RuntimeError, match="ran over 5s and was killed"):
        run_pytest(
            sys.executable,
            ["test_hangs.py"],
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin"},
            report=report,
            timeout=5,
        )
    pid = int((tmp_path / "child.pid").read_text())
    time.sleep(0.5)
    assert not _alive(pid)  # the process it started went with it


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"
