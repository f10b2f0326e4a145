"""What a provisioned kernel takes from the machine that starts it: the environment variables the
user names, and the files the user names, uploaded into the kernel's working directory.

A local kernel inherits its launcher's environment and starts in the notebook's directory;
papermill and nbclient users rely on both (``os.environ["DATA_URL"]``, ``open("data.csv")``). A
kernel in a VM inherits nothing, so the user names what goes (the provisioner's config, or
``KERNELHOST_FORWARD_ENV`` / ``KERNELHOST_UPLOAD`` at run time; docs/jupyter.md):

- ``forwarded_env``: the named variables (``*``/``?`` patterns allowed) and those the kernelspec
  sets in its ``env``, with the values of the environment jupyter_client made for the kernel;
- ``upload_plan``: the named files and directories (glob patterns allowed), relative to the
  notebook's working directory, each with the path it gets under the kernel's working directory;
- ``setup_code``: the silent cell the bridge runs in the kernel before any client's message, on
  each start and restart (a restart is a fresh kernel process): the variables set and the
  working directory entered.

Pure functions: no HTTP, nothing of the server.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

FORWARD_ENV_VAR = "KERNELHOST_FORWARD_ENV"
UPLOAD_VAR = "KERNELHOST_UPLOAD"
MAX_UPLOAD_FILES = 10_000
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PATTERN = re.compile(r"[A-Za-z0-9_*?\[\]!]+")
_MAGIC = re.compile(r"[*?[]")


class WorkdirError(ValueError):
    """A named file that cannot go; the message names it and the fix."""


def named(configured: Iterable[str], env: Mapping[str, str], var: str) -> list[str]:
    """The configured entries, then those of the comma-separated variable ``var`` of ``env``."""
    extra = [e.strip() for e in env.get(var, "").split(",")]
    return [e for e in [*(c.strip() for c in configured), *extra] if e]


def forwarded_env(
    env: Mapping[str, str], names: Iterable[str], spec_env: Iterable[str] = (), keep_out: Iterable[str] = ()
) -> dict[str, str]:
    """The variables of ``env`` that ``names`` (names or patterns) or the kernelspec's ``env``
    name. A pattern never matches a name in ``keep_out`` (the API key's variable): that one
    goes only when named exactly."""
    wanted, patterns = set(spec_env), []
    for name in names:
        if _NAME.fullmatch(name):
            wanted.add(name)
        elif _PATTERN.fullmatch(name):
            patterns.append(name)
        else:
            raise WorkdirError(
                f"{name!r} is not an environment variable name or pattern (letters, digits, _, * and ?)"
            )
    hidden = set(keep_out) - wanted
    for key in env:
        if key not in hidden and any(fnmatch.fnmatchcase(key, p) for p in patterns):
            wanted.add(key)
    return {k: env[k] for k in sorted(wanted) if k in env}


def upload_plan(cwd: Path, entries: Iterable[str]) -> list[tuple[Path, str]]:
    """``(local file, path under the kernel's working directory)`` for every file ``entries``
    name: a file, a directory (all the files under it) or a glob pattern, relative to ``cwd``.
    A file under ``cwd`` keeps its path relative to it; one outside goes under its own name."""
    plan: dict[str, Path] = {}
    for entry in entries:
        pattern = os.path.expanduser(entry)
        if _MAGIC.search(pattern):
            found = sorted(glob.glob(pattern, root_dir=cwd, recursive=True))
            if not found:
                raise WorkdirError(f"upload {entry!r}: nothing in {cwd} matches it")
            paths = [cwd / f for f in found]
        else:
            paths = [cwd / pattern]
            if not paths[0].exists():
                raise WorkdirError(f"upload {entry!r}: no such file or directory in {cwd}")
        for path in paths:
            for file in sorted(path.rglob("*")) if path.is_dir() else [path]:
                if file.is_file():
                    plan.setdefault(_remote_name(cwd, path, file), file)
        if len(plan) > MAX_UPLOAD_FILES:
            raise WorkdirError(
                f"upload {entry!r}: more than {MAX_UPLOAD_FILES} files; name fewer, or pack them"
            )
    return [(local, remote) for remote, local in sorted(plan.items())]


def _remote_name(cwd: Path, named_path: Path, file: Path) -> str:
    """``file``'s path relative to ``cwd`` as named (symlinks not followed), or, outside it,
    relative to the parent of the path that named it."""
    rel = os.path.relpath(os.path.abspath(file), os.path.abspath(cwd))
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        rel = os.path.relpath(os.path.abspath(file), os.path.dirname(os.path.abspath(named_path)))
    return Path(rel).as_posix()


def remote_path(working_dir: str, name: str) -> str:
    """Where an uploaded file goes in the VM (a relative working directory is under the
    kernel's home, /home/user, as the files API takes it)."""
    return f"{working_dir.rstrip('/')}/{name}" if working_dir else name


def setup_code(env: Mapping[str, str], working_dir: str) -> str:
    """The silent cell that sets ``env`` and enters ``working_dir`` in the kernel ("" if there
    is nothing to do). Values travel as Python literals (``repr``), never as code."""
    lines = ["import os as __kernelhost_os"]
    if env:
        lines.append(f"__kernelhost_os.environ.update({dict(env)!r})")
    if working_dir:
        lines.append(f"__kernelhost_wd = __kernelhost_os.path.expanduser({working_dir!r})")
        lines.append("__kernelhost_os.makedirs(__kernelhost_wd, exist_ok=True)")
        lines.append("__kernelhost_os.chdir(__kernelhost_wd)")
        lines.append("del __kernelhost_wd")
    lines.append("del __kernelhost_os")
    return "\n".join(lines) if env or working_dir else ""
