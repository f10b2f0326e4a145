"""The pip step of a built-in image (guest-image/build.py): a template's pinned ``pip``
packages (templates.json), fetched by the host's pip from the index it is configured with and
installed into the root offline.

Standard library only, like build.py.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: ``run(argv, **kw)`` and ``stage(name, detail)`` of build.py
Run = Callable[..., Any]


def host_pip() -> list[str]:
    """A pip on the host (it reads the host's own index configuration): this interpreter's, or
    the project's virtualenv's (``make image`` makes it first)."""
    for python in (sys.executable, str(REPO / ".venv" / "bin" / "python")):
        probe = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, check=False)
        if probe.returncode == 0:
            return [python, "-m", "pip"]
    raise SystemExit(
        "templates.json asks for pip packages, and no pip was found on the host to fetch them: "
        "install python3-pip, or run `make image` (it makes the project's virtualenv first)"
    )


def install_wheels(
    root: Path, requirements: list[str], work: Path, run: Run, stage: Callable[[str, str], None]
) -> dict[str, str]:
    """The template's ``pip`` packages (pinned, pure Python): the host's pip fetches their
    wheels from the index it is configured with, and the guest's pip installs exactly those,
    offline, with no dependency of theirs beyond what the distribution's packages give.
    Returns {name: version} for the manifest."""
    if not requirements:
        return {}
    unpinned = [r for r in requirements if not re.fullmatch(r"[A-Za-z0-9_.-]+==[A-Za-z0-9_.+!-]+", r)]
    if unpinned:
        raise SystemExit(f"templates.json: pip entries must be pinned as name==version: {unpinned}")
    stage("pip", ", ".join(requirements))
    wheels = root / "tmp" / "kernelhost-wheels"
    wheels.mkdir(parents=True)
    fetch = ["download", "--quiet", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check"]
    run([*host_pip(), *fetch, "--dest", str(wheels), *requirements], cwd=work)
    names = sorted(p.name for p in wheels.glob("*.whl"))
    run(
        [
            "chroot", str(root), "python3", "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
            "--break-system-packages", "--root-user-action=ignore", "--disable-pip-version-check",
            *[f"/tmp/kernelhost-wheels/{n}" for n in names],
        ]
    )  # fmt: skip
    shutil.rmtree(wheels)
    return {r.split("==")[0].lower().replace("_", "-"): r.split("==")[1] for r in requirements}
