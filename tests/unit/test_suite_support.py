"""The runner of other projects' suites (tests/clients/suite_support.py) on a small suite of
its own: what its JUnit report says becomes the counts, with why each case failed, erred or was
skipped, and a deselected case is counted and its reason printed."""

from __future__ import annotations

import sys
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
    assert SUMMARY[-1] == line
    SUMMARY.pop()  # not a real suite: out of the session's summary
    printed = capsys.readouterr().out
    assert "deselected test_theirs.py::test_left_out: cannot apply here" in printed
    assert "skipped test_skipped: not here" in printed
