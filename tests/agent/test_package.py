"""The agent as the guest image holds it: its layout in the rootfs, its imports, its size."""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from .conftest import AGENT_DIR

pytestmark = pytest.mark.unit

REPO = AGENT_DIR.parents[1]
PACKAGE = AGENT_DIR / "kernelhost_agent"
MODULE_LINES_MAX = 500
FUNCTION_LINES_MAX = 80


def load_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_guest_image_build", REPO / "guest-image" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def overlay(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``install_overlay`` puts into a rootfs (its closing compileall chroot not run)."""
    build = load_build()
    commands: list[Any] = []
    root = tmp_path_factory.mktemp("rootfs")
    (root / "sbin").mkdir()
    (root / "etc").mkdir()
    (PACKAGE / "__pycache__").mkdir(exist_ok=True)  # as a test run leaves it
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "run", lambda cmd, **kw: commands.append(cmd))
        build.install_overlay(root)
    assert commands == [["chroot", str(root), "python3", "-m", "compileall", "-q", "/opt/kernelhost"]]
    return root


def test_overlay_holds_the_package_and_the_shared_modules(overlay: Path) -> None:
    opt = overlay / "opt" / "kernelhost"
    assert sorted(p.name for p in opt.iterdir()) == [
        "codec.py",
        "kernel_displays.py",
        "kernel_interrupt.py",
        "kernel_limits.py",
        "kernel_reseed.py",
        "kernel_wire.py",
        "kernelhost_agent",
        "launch_kernel.py",
        "protocol.py",
    ]
    shipped = sorted(p.name for p in (opt / "kernelhost_agent").iterdir())
    assert shipped == sorted(p.name for p in PACKAGE.glob("*.py"))  # no __pycache__
    assert (opt / "protocol.py").read_bytes() == (REPO / "kernelhost/channel/protocol.py").read_bytes()


def test_overlay_kernelspec_is_unchanged(overlay: Path) -> None:
    spec = json.loads((overlay / "usr/local/share/jupyter/kernels/kernelhost/kernel.json").read_text())
    assert spec["argv"] == [
        "/usr/bin/python3",
        "/opt/kernelhost/launch_kernel.py",
        "-f",
        "{connection_file}",
        "--HistoryManager.hist_file=:memory:",
    ]
    assert spec["interrupt_mode"] == "signal"


def test_init_starts_the_package_under_tini(overlay: Path) -> None:
    lines = (overlay / "sbin" / "kernelhost-init").read_text().strip().splitlines()
    assert lines[-2:] == [
        "cd /opt/kernelhost",
        "exec /usr/bin/tini -s -- /usr/bin/python3 -u -m kernelhost_agent",
    ]


def test_the_guest_copy_imports_without_the_kernelhost_package(overlay: Path) -> None:
    """The guest has no kernelhost package: the shim must fall back to the copied modules."""
    opt = overlay / "opt" / "kernelhost"
    # -I -S: no site processing, so the editable install of kernelhost is not on the path; the
    # interpreter's site-packages is added by hand for jupyter_client, zmq and msgpack.
    site = sysconfig.get_paths()["purelib"]
    code = (
        f"import sys; sys.path[:0] = [{str(opt)!r}, {site!r}]\n"
        "import kernelhost_agent.__main__, kernelhost_agent.agent\n"
        "from kernelhost_agent import shared\n"
        "assert 'kernelhost' not in sys.modules, 'the host package was imported'\n"
        "print(shared.codec.__file__, shared.protocol.__file__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(opt / "codec.py"), str(opt / "protocol.py")]


def test_no_module_or_function_is_too_long() -> None:
    too_long = []
    for path in sorted(PACKAGE.glob("*.py")):
        source = path.read_text()
        if len(source.splitlines()) > MODULE_LINES_MAX:
            too_long.append(f"{path.name}: {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNCTION_LINES_MAX:
                    too_long.append(f"{path.name}: {node.name} has {length} lines")
    assert not too_long, too_long


def test_the_old_single_file_agent_is_gone() -> None:
    assert not (AGENT_DIR / "kernelhost_agent.py").exists()


def test_a_build_stopped_half_way_unmounts_before_it_removes_its_tree(tmp_path: Path) -> None:
    """mmdebstrap stopped mid-way leaves the host's /dev/shm mounted in the root: the tree goes
    only after everything under it is unmounted (else the removal empties the host's)."""
    build = load_build()
    steps: list[str] = []

    def stopped(root: Path, *args: Any) -> None:
        (root / "dev" / "shm").mkdir(parents=True)
        raise KeyboardInterrupt  # Ctrl-C, or make's SIGTERM turned into SystemExit

    def rmtree(path: Path, ignore_errors: bool = False) -> None:
        steps.append(f"rmtree {Path(path).name[:7]}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "build_rootfs", stopped)
        patch.setattr(build, "unmount_all", lambda work: steps.append(f"unmount {work.name[:7]}"))
        patch.setattr(build.shutil, "rmtree", rmtree)
        with pytest.raises(KeyboardInterrupt):
            build._build("python", {}, tmp_path, "bookworm", ("", ""), "k", tmp_path / "f", tmp_path / "l")
    assert steps == ["unmount .build-", "rmtree .build-"]
