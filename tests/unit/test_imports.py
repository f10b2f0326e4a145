"""Import hygiene over every module: no import cycles between modules, type-only imports (under
``TYPE_CHECKING``) and imports inside functions included; and every module imports alone.

A cycle is a pair of modules that each need the other, however indirectly: neither can be read,
tested or moved alone. Where a module needs only the shape of the one that owns it, it names
that shape as a ``Protocol`` of its own (``vm/fork.py``'s ``VmFactory``, ``checkpoints/auto.py``'s
``Owner``, ``sandbox.py``'s ``AttachedKernel``) instead of importing its owner.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
# the packages whose modules import one another (the guest agent is one package of its own)
ROOTS = (REPO / "kernelhost", REPO / "hypervisor", REPO / "guest-image" / "agent" / "kernelhost_agent")


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of ROOTS by dotted name: its file, and whether it is a package."""
    mods = {}
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root.parent).with_suffix("").parts)
            package = parts[-1] == "__init__"
            mods[".".join(parts[:-1] if package else parts)] = (path, package)
    return mods


def _imports(name: str, path: Path, package: bool, mods: dict[str, tuple[Path, bool]]) -> set[str]:
    """The modules of ``mods`` that ``name`` imports anywhere in its file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = name.split(".") if package else name.split(".")[:-1]
                here = here[: len(here) - node.level + 1]
                base = ".".join([*here, base] if base else here)
            # ``from package import module`` imports the module, not the package's face
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        for target in targets:
            while target and target not in mods:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_cycles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    mods = _modules()
    graph = {name: _imports(name, path, package, mods) for name, (path, package) in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_import_cycles_between_modules() -> None:
    cycles = import_cycles()
    assert len(cycles) == 0, f"{len(cycles)} import cycles: {cycles}"


def test_the_cycle_count_sees_a_type_only_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a cycle closed only by an import under TYPE_CHECKING counts."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nclass B: ...\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", (pkg,))
    assert import_cycles() == [["pkg.a", "pkg.b"]]


# What the forked interpreters hold before each import: the standard library and the
# third-party packages most of ours load (importing them is not what this test is about).
THIRD_PARTY = (
    "aiohttp.web",
    "jupyter_client",
    "libvirt",
    "msgpack",
    "prometheus_client",
    "structlog",
    "zstandard",
    # the agent frameworks and the MCP SDK (pydantic, starlette): seconds each, under emulation
    # the largest part of the forks' time
    "agents",
    "mcp",
    "pydantic",
    "starlette",
    "anyio",
    "httpx",
    "opentelemetry.trace",
    "cryptography",
)

# Each of ours imported first, in a fork of an interpreter that holds none of ours; as many
# forks at once as there are CPUs.
FORKER = """
import importlib, json, os, sys, traceback
for name in sys.argv[2:]:
    importlib.import_module(name)
names, running, failures = json.loads(sys.argv[1]), {}, {}

def reap():
    pid, status = os.wait()
    name, r = running.pop(pid)
    with os.fdopen(r, "rb") as out:
        text = out.read().decode()
    if status:
        failures[name] = text[-800:]

for name in names:
    if len(running) >= (os.cpu_count() or 1):
        reap()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            importlib.import_module(name)
            code = 0
        except BaseException:
            os.write(w, traceback.format_exc(limit=3).encode())
            code = 1
        os._exit(code)
    os.close(w)
    running[pid] = (name, r)
while running:
    reap()
print(json.dumps(failures))
"""


def _run(script: str, *args: str) -> object:
    out = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        timeout=240,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_module_imports_alone() -> None:
    """aiohttp's habit: each module imported first, in an interpreter that holds none of ours
    (a fork of one with only the standard library and the third-party packages loaded), so a
    module that works only when another was imported before it fails here."""
    # the guest agent imports in the guest's layout (tests/agent); a __main__ runs its command
    ours = [n for n in _modules() if not n.startswith("kernelhost_agent") and not n.endswith(".__main__")]
    names = json.dumps(ours)
    failures = _run(FORKER, names, *THIRD_PARTY)
    assert not failures, failures
