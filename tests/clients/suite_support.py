"""Running other projects' test suites, unmodified, against the service (test_*_suite.py).

A suite comes from the package registry at test time, never copied into this tree: its wheel
is downloaded and unpacked, or its packages are installed into a virtualenv of its own when
they would fight the project's (LangChain's pull pytest plugins and older pins). Both are
cached, keyed by the pins, under ``$KERNELHOST_SUITES_CACHE`` (default
``~/.cache/kernelhost/suites``), outside the repository, so a second run costs nothing.

The suite runs under pytest in a subprocess with an ini file of ours (not the project's
setup.cfg, not its conftest files); its JUnit XML report gives the counts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from xml.etree import ElementTree

#: what every suite run gets: no cache written next to the suite, short tracebacks, and
#: pytest's own output for the log
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider -rfEs --tb=short\n"
#: each run's count line, for the terminal summary (tests/clients/conftest.py)
SUMMARY: list[str] = []


def cache_dir() -> Path:
    configured = os.environ.get("KERNELHOST_SUITES_CACHE")
    if configured:
        path = Path(configured)
    else:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        path = Path(base) / "kernelhost" / "suites"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time builds ``path`` (other people's test runs share the cache)."""
    with (path.parent / f".{path.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pip(python: str, *args: str, timeout: float) -> None:
    done = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        raise RuntimeError(f"pip {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def unpacked_wheel(name: str, version: str) -> Path:
    """``name==version``'s wheel from the registry, unpacked (cached)."""
    target = cache_dir() / f"wheel-{name}-{version}"
    with _locked(target):
        if not (target / ".complete").is_file():
            download = cache_dir() / f"download-{name}-{version}"
            download.mkdir(exist_ok=True)
            _pip(
                sys.executable,
                *("download", f"{name}=={version}", "--no-deps", "--only-binary", ":all:"),
                *("--dest", str(download)),
                timeout=300,
            )
            (wheel,) = download.glob("*.whl")
            with zipfile.ZipFile(wheel) as archive:
                archive.extractall(target)
            (target / ".complete").write_text(wheel.name + "\n")
    return target


def suite_venv(name: str, requirements: list[str]) -> Path:
    """A virtualenv with ``requirements`` installed (cached by their hash); its python."""
    digest = hashlib.sha256("\n".join(sorted(requirements)).encode()).hexdigest()[:12]
    target = cache_dir() / f"venv-{name}-{digest}"
    python = target / "bin" / "python"
    with _locked(target):
        if not (target / ".complete").is_file():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(target)], check=True, timeout=300)
            _pip(str(python), "install", "--quiet", *requirements, timeout=900)
            (target / ".complete").write_text("\n".join(requirements) + "\n")
    return python


@dataclass
class Counts:
    """What a suite's run came to, from its JUnit XML report."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    deselected: int = 0
    seconds: float = 0.0
    #: test name -> the first line of why it failed, erred or was skipped
    problems: dict[str, str] = field(default_factory=dict)
    skips: dict[str, str] = field(default_factory=dict)
    #: the names of the cases that passed
    passes: set[str] = field(default_factory=set)
    #: node id -> why it was left out (the runner's ``deselect``)
    left_out: dict[str, str] = field(default_factory=dict)
    output: str = ""

    def report(self, suite: str) -> str:
        """The count line of ``suite``: printed, and kept for the session's summary."""
        line = (
            f"{suite}: {self.passed} passed, {self.failed} failed, {self.errors} errors, "
            f"{self.skipped} skipped, {self.deselected} deselected in {self.seconds:.0f}s"
        )
        notes = [f"  deselected {node}: {why}" for node, why in self.left_out.items()]
        notes += [f"  skipped {name}: {why}" for name, why in self.skips.items()]
        print("\n".join([line, *notes]))
        SUMMARY.extend([line, *notes])  # the closing note names each case left out, and why
        return line


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:300] if (text or "").strip() else ""


def _read_junit(path: Path, counts: Counts) -> None:
    """Each case's last outcome: a case run again (flaky's ``@flaky`` reruns a failed case, and
    the report keeps both runs) counts once."""
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        owner = case.get("classname", "").rsplit(".", 1)[-1]
        if owner[:1].isupper():  # a method: its class names it (two classes may share a name)
            name = f"{owner}::{name}"
        outcomes.pop(name, None)  # the last run is the one that counts (and comes last)
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcomes[name] = (kind, _first_line(found.get("message")))
                break
        else:
            outcomes[name] = ("passed", "")
    for name, (kind, why) in outcomes.items():
        if kind == "passed":
            counts.passed += 1
            counts.passes.add(name)
        elif kind == "skipped":
            counts.skipped += 1
            counts.skips[name] = why
        else:
            counts.failed += kind == "failure"
            counts.errors += kind == "error"
            counts.problems[name] = why


def _run_group(cmd: list[str], *, cwd: Path, env: dict[str, str], timeout: float) -> tuple[str, str]:
    """``cmd``'s output; past ``timeout`` its whole process group is killed (a suite's own
    worker processes too, which a plain ``subprocess.run`` would leave running) and
    its output raised as ``RuntimeError``."""
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise RuntimeError(
            f"{cmd[:3]} ... ran over {timeout:g}s and was killed:\n{stdout[-4000:]}\n{stderr[-2000:]}"
        ) from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the suite's outlives it
    return stdout, stderr


def run_pytest(
    python: str | Path,
    args: list[str],
    *,
    cwd: Path,
    env: dict[str, str],
    report: Path,
    ini: str = "",
    deselect: dict[str, str] | None = None,
    timeout: float = 1800,
) -> Counts:
    """pytest ``args`` under ``python`` in ``cwd`` with an ini file of ours (``PYTEST_INI`` and
    the lines ``ini``, beside ``report``), the cases of ``deselect`` (node id -> why) left out;
    the counts, printed with every reason."""
    deselect = deselect or {}
    config = report.parent / "pytest.ini"
    config.write_text(PYTEST_INI + ini)
    for node, why in deselect.items():
        print(f"deselected {node}: {why}")
    cmd = [str(python), "-m", "pytest", "-c", str(config), "--rootdir", str(cwd), "--confcutdir", str(cwd)]
    cmd += [f"--junitxml={report}", *args]
    for node in deselect:
        cmd += ["--deselect", node]
    started = time.monotonic()
    stdout, stderr = _run_group(cmd, cwd=cwd, env=env, timeout=timeout)
    counts = Counts(seconds=time.monotonic() - started, output=stdout + stderr, left_out=dict(deselect))
    summary = re.search(r"(\d+) deselected", stdout)
    counts.deselected = int(summary.group(1)) if summary else 0
    if not report.is_file():
        raise RuntimeError(f"pytest wrote no report:\n{counts.output[-5000:]}")
    _read_junit(report, counts)
    print(counts.output[-3000:])
    for name, why in counts.skips.items():
        print(f"skipped {name}: {why}")
    return counts
