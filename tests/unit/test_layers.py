"""Imports run one way (design.md): check each layer in a clean interpreter."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGES = [
    "hypervisor",
    "kernelhost",
    "kernelhost.channel",
    "kernelhost.channel.codec",
    "kernelhost.sandboxes",
    "kernelhost.sandboxes.lifecycle",
    "kernelhost.sandboxes.vm",
    "kernelhost.sandboxes.checkpoints",
    "kernelhost.sandboxes.templates",
    "kernelhost.sandboxes.store",
    "kernelhost.sandboxes.execution",
    "kernelhost.sandboxes.network",
    "kernelhost.sandboxes.cluster",
    "kernelhost.api",
    "kernelhost.client",
    "kernelhost.cli",
    "kernelhost.integrations",
    "kernelhost.jupyter",
]


def loaded_after(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", PACKAGES)
def test_every_package_imports_alone(module: str) -> None:
    loaded_after(module)  # raises on circular or missing imports


def test_hypervisor_knows_nothing_of_http_jupyter_or_the_service() -> None:
    mods = loaded_after("hypervisor")
    assert not {m for m in mods if m.split(".")[0] in ("aiohttp", "jupyter_client", "kernelhost")}


def test_codec_is_sans_io_and_standalone() -> None:
    """The guest imports codec.py as a lone file: it may need nothing but msgpack."""
    from pathlib import Path

    import kernelhost.channel.codec as codec

    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import codec; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(Path(codec.__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    mods = set(json.loads(out.stdout))
    assert not {m for m in mods if m.split(".")[0] in ("asyncio", "aiohttp", "kernelhost")}


def test_channel_and_sandboxes_do_not_know_http() -> None:
    for module in ("kernelhost.channel", "kernelhost.sandboxes"):
        mods = loaded_after(module)
        assert "aiohttp.web" not in mods and "kernelhost.api" not in mods, module


def test_sdk_imports_nothing_of_the_server() -> None:
    mods = loaded_after("kernelhost")
    server = {
        "kernelhost.api",
        "kernelhost.sandboxes",
        "kernelhost.channel",
        "hypervisor",
        "libvirt",
        "jupyter_client",
        "aiohttp.web",
    }
    assert not mods & server


def test_the_guest_shares_codec_and_protocol_standalone() -> None:
    """The image build copies codec.py and protocol.py next to the agent, which imports them as
    lone top-level modules: they may need nothing but the standard library and msgpack."""
    from pathlib import Path

    import kernelhost.channel.codec as codec

    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import codec, protocol; "
        "print(json.dumps(sorted(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(Path(codec.__file__).parent)],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    )
    mods = set(json.loads(out.stdout))
    assert not {m for m in mods if m.split(".")[0] in ("asyncio", "aiohttp", "kernelhost")}


def _private_names(package: Path) -> set[str]:
    """Every underscore name a package defines: functions, classes, methods, attributes."""
    names: set[str] = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.mark.parametrize("layer", ["api", "integrations", "jupyter", "cli"])
def test_no_caller_outside_the_sandbox_layer_touches_its_private_names(layer: str) -> None:
    """The manager's public API is the sandbox layer's only door: whoever changes its internals
    (its locking, say) must not find them used elsewhere."""
    root = Path(__file__).resolve().parents[2] / "kernelhost"
    private = _private_names(root / "sandboxes")
    target = root / layer
    files = [target] if target.is_file() else sorted(target.rglob("*.py"))
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and "sandboxes" in node.module:
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.startswith("_")]
            if (
                isinstance(node, ast.Attribute)
                and node.attr in private
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
    assert not found, found


def _sandbox_imports(path: Path, root: Path) -> list[tuple[int, str, list[str]]]:
    """Each import of the sandbox layer in ``path`` (relative ones resolved, type-only and
    function-level ones included): its line, module and names."""
    package = list(path.relative_to(root.parent).with_suffix("").parts)
    package = package[:-1]  # a module's package (an __init__'s is its own)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((node.lineno, module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
    return [f for f in found if f[1] == "kernelhost.sandboxes" or f[1].startswith("kernelhost.sandboxes.")]


#: the service's start-up opens the store (``open_store``) and holds it: these API modules alone
#: also enter the layer by the store's own face, ``kernelhost.sandboxes.store``
WIRING_USERS = {"app.py", "state.py"}


def test_the_api_enters_the_sandbox_layer_by_its_face_only() -> None:
    """``kernelhost/api`` imports ``kernelhost.sandboxes`` by the names of its face (``__all__``),
    never a module of it by path; the service's start-up alone also uses the store's face."""
    import kernelhost.sandboxes as face
    import kernelhost.sandboxes.store as store

    root = Path(__file__).resolve().parents[2] / "kernelhost"
    found = []
    for path in sorted((root / "api").rglob("*.py")):
        where = path.relative_to(root)
        for line, module, names in _sandbox_imports(path, root):
            if module == "kernelhost.sandboxes":
                found += [f"{where}:{line}: {n} is not on the face" for n in names if n not in face.__all__]
            elif module == "kernelhost.sandboxes.store" and path.name in WIRING_USERS:
                found += [f"{where}:{line}: {n} not on store's face" for n in names if n not in store.__all__]
            else:
                found.append(f"{where}:{line}: imports {module} by path")
    assert not found, found


def test_the_face_exports_only_what_callers_outside_the_layer_use() -> None:
    """Every name of ``kernelhost.sandboxes.__all__`` is imported by some module of kernelhost
    outside the layer: a name nobody outside uses belongs to its family's own face."""
    import kernelhost.sandboxes as face

    root = Path(__file__).resolve().parents[2] / "kernelhost"
    used: set[str] = set()
    for path in root.rglob("*.py"):
        if (root / "sandboxes") not in path.parents:
            used.update(n for _, module, names in _sandbox_imports(path, root) for n in names)
    assert sorted(set(face.__all__) - used) == []
