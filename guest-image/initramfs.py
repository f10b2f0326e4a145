"""The initramfs stage of the guest image build: a static busybox, ``init`` and the kernel
modules the guest needs to mount its root (virtio, erofs, overlay), in dependency order.

Standard library only, like build.py, which imports it.
"""

from __future__ import annotations

import lzma
import shutil
import subprocess
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

# Loaded by the initramfs; their dependencies are added and ordered from modules.dep.
INITRAMFS_MODULES = [
    "virtio_pci",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "virtio_rng",
    "erofs",
    "overlay",
]


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    return subprocess.run(cmd, check=True, **kw)


def module_order(modules: Path, wanted: list[str]) -> list[str]:
    """Module files (relative to ``modules``) for ``wanted`` and their deps, deps first."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in (modules / "modules.dep").read_text().splitlines():
        mod, _, rest = line.partition(":")
        deps[mod] = rest.split()
        name = Path(mod).name.split(".ko")[0].replace("-", "_")
        by_name[name] = mod
    builtin = (modules / "modules.builtin").read_text() if (modules / "modules.builtin").exists() else ""
    builtin_names = {Path(ln).name.split(".ko")[0].replace("-", "_") for ln in builtin.split()}
    order: list[str] = []

    def visit(mod: str) -> None:
        if mod in order:
            return
        for dep in deps.get(mod, []):
            visit(dep)
        order.append(mod)

    for name in wanted:
        if name in by_name:
            visit(by_name[name])
        elif name not in builtin_names:
            raise SystemExit(f"kernel module {name!r} is neither a module nor built in")
    return order


def build_initramfs(modules: Path, out: Path, work: Path) -> list[str]:
    """The initrd (``out/initrd.img``): static busybox, ``init`` and the modules, in load order;
    returns the module files it holds."""
    tree = work / "initramfs"
    (tree / "bin").mkdir(parents=True)
    (tree / "modules").mkdir()
    busybox = shutil.which("busybox") or "/bin/busybox"
    shutil.copy2(busybox, tree / "bin" / "busybox")
    shutil.copy2(HERE / "init", tree / "init")
    (tree / "init").chmod(0o755)
    names = []
    for mod in module_order(modules, INITRAMFS_MODULES):
        src = modules / mod
        name = Path(mod).name
        data = src.read_bytes()
        if name.endswith(".xz"):
            data, name = lzma.decompress(data), name[:-3]
        elif name.endswith(".zst"):
            data = run(["zstd", "-dc", str(src)], capture_output=True).stdout
            name = name[:-4]
        (tree / "modules" / name).write_bytes(data)
        names.append(name)
    (tree / "modules.order").write_text("\n".join(names) + "\n")
    files = run(["find", ".", "-mindepth", "1"], cwd=tree, capture_output=True, text=True).stdout
    cpio = run(
        ["cpio", "-o", "-H", "newc", "--quiet"], cwd=tree, input=files.encode(), capture_output=True
    ).stdout
    with open(out / "initrd.img", "wb") as image:
        run(["gzip", "-9"], input=cpio, stdout=image)
    return names
