#!/usr/bin/env python3
"""Build a kernelhost guest image for one template: kernel, initramfs, read-only erofs root.

    python3 guest-image/build.py [--image-dir DIR] [--force] TEMPLATE...

Output goes to ``DIR/<template>-<key>/`` (``vmlinuz``, ``initrd.img``, ``rootfs.erofs``,
``manifest.json``) and ``DIR/<template>`` is a symlink to the newest build. ``key`` hashes every
input (this directory, the channel codec, the template's package list, the host's apt sources
and architecture), so an unchanged template is never rebuilt. ``DIR`` defaults to
``$KERNELHOST_IMAGE_DIR`` or ``/var/cache/kernelhost/images``.

Stages: rootfs (mmdebstrap from the host's apt sources) -> kernel (the distribution's cloud
kernel, taken out of that rootfs) -> overlay (agent, codec, init, kernelspec) -> pip (a
template's pinned ``pip`` packages, fetched by the host's pip, installed offline) -> erofs ->
initramfs (static busybox + the virtio/erofs/overlay modules in dependency order).

On a terminal the stages show as a progress bar (``kernelhost/progress.py``, loaded by path);
otherwise as plain lines, one per stage.

Standard library only: it runs before the project's virtualenv exists.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # loaded by path (the tests do): its sibling modules still import
    sys.path.insert(0, str(HERE))

from account import add_user  # noqa: E402  (guest-image/account.py)
from buildroot import unmount_all  # noqa: E402  (guest-image/buildroot.py)
from initramfs import build_initramfs  # noqa: E402  (guest-image/initramfs.py)
from sources import codename, host_sources, sources_for  # noqa: E402  (guest-image/sources.py)
from wheels import install_wheels  # noqa: E402  (guest-image/wheels.py)

if TYPE_CHECKING:  # for the annotations only: at run time the module is loaded by path
    from kernelhost.progress import Stages

REPO = HERE.parent
CODEC = REPO / "kernelhost" / "channel" / "codec.py"
PROTOCOL = REPO / "kernelhost" / "channel" / "protocol.py"
# the kernel's side files, beside the agent package in /opt/kernelhost (launch_kernel.py runs)
KERNEL_FILES = (
    "launch_kernel.py",
    "kernel_limits.py",
    "kernel_interrupt.py",
    "kernel_reseed.py",
    "kernel_wire.py",
    "kernel_displays.py",
)
DEFAULT_IMAGE_DIR = "/var/cache/kernelhost/images"

BASE_PACKAGES = [
    "apt",  # for template layers (guest-image/layer.py); the essential variant has none
    "erofs-utils",  # a template's layer is packed inside its build VM (layer.py), not on the host
    "python3",
    "python3-ipykernel",
    "python3-jupyter-client",
    "python3-zmq",
    "python3-msgpack",
    "bash-static",  # what the agent runs commands in (kernelhost_agent/bash.py)
    "busybox",
    "tini",
    # what programs written for E2B's images and models' scripts run: `python script.py`, ...
    *("python-is-python3", "curl", "git", "sudo", "ca-certificates"),
]
KERNEL_PACKAGE = "linux-image-cloud-amd64"
EXCLUDED_PATHS = [
    "/usr/share/man/*",
    "/usr/share/doc/*",
    "/usr/share/info/*",
    "/usr/share/locale/*",
    "/usr/share/lintian/*",
    "/usr/share/bug/*",
]


STAGES = ["rootfs", "kernel", "overlay", "pip", "warm-up", "erofs", "initramfs"]
_BAR: Stages | None = None  # the build's progress bar while one is drawn on a terminal


def _progress_module() -> ModuleType | None:
    """kernelhost/progress.py (standard library only), loaded by path: the kernelhost package
    itself needs the virtualenv. None if it is missing; the build then logs plain lines."""
    path = REPO / "kernelhost" / "progress.py"
    spec = importlib.util.spec_from_file_location("_kernelhost_progress", path)
    if spec is None or spec.loader is None or not path.is_file():
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def log(msg: str) -> None:
    line = f"[image {time.strftime('%H:%M:%S')}] {msg}"
    if _BAR is not None:
        _BAR.echo(line)
    else:
        print(line, flush=True)


def stage(name: str, detail: str = "") -> None:
    """Enter a build stage: the bar moves on a terminal; elsewhere one plain line."""
    if _BAR is not None:
        _BAR.stage(name, detail)
    else:
        log(f"{name}: {detail}" if detail else name)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    if _BAR is None or not _BAR.tty or {"stderr", "input", "capture_output"} & kw.keys():
        return subprocess.run(cmd, check=True, **kw)
    # under a bar: the tool's own messages (mmdebstrap's "I: ...") go above it, line by line
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", **kw)
    assert proc.stderr is not None
    for text in proc.stderr:
        _BAR.echo("  " + text.rstrip("\n"))
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    return subprocess.CompletedProcess(cmd, proc.returncode)


def load_templates() -> dict[str, dict[str, Any]]:
    templates: dict[str, dict[str, Any]] = json.loads((HERE / "templates.json").read_text())
    return templates


#: build inputs of template layers only: a change to them rebuilds layers, not full images
LAYER_INPUTS = ("layer.py", "buildroot.py")


def image_key(template: str, spec: dict[str, Any], sources: tuple[str, str]) -> str:
    h = hashlib.sha256()
    inputs = sorted(
        p
        for p in HERE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.relative_to(HERE).as_posix() not in LAYER_INPUTS
    )
    for path in [*inputs, CODEC, PROTOCOL]:
        h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(json.dumps([template, spec, sources, platform.machine()], sort_keys=True).encode())
    return h.hexdigest()[:16]


def stub_repo(stubs: dict[str, str], work: Path) -> str | None:
    """A local apt repository of empty packages standing in for dependencies a template must not
    pull (templates.json: ``stub_packages`` maps a package name to the reason). Their version
    sorts above any real one, so apt takes them; the ``copy:`` method copies them into the
    rootfs's apt cache, where the chrooted dpkg finds them. Returns the sources line, or None."""
    if not stubs:
        return None
    repo = work / "stubs"
    stanzas = []
    for name, reason in sorted(stubs.items()):
        tree = work / "stub-trees" / name
        (tree / "DEBIAN").mkdir(parents=True)
        control = (
            f"Package: {name}\nVersion: 99:0-kernelhost.stub\nArchitecture: all\n"
            f"Maintainer: kernelhost <kernelhost@localhost>\nPriority: optional\n"
            f"Description: empty stand-in for {name} (kernelhost guest image)\n"
            f" {reason}\n"
        )
        (tree / "DEBIAN" / "control").write_text(control)
        repo.mkdir(exist_ok=True)
        deb = repo / f"{name}.deb"
        run(["dpkg-deb", "--root-owner-group", "--build", str(tree), str(deb)], stdout=subprocess.DEVNULL)
        data = deb.read_bytes()
        stanzas.append(
            control.rstrip("\n") + f"\nFilename: ./{deb.name}\nSize: {len(data)}\n"
            f"SHA256: {hashlib.sha256(data).hexdigest()}\n"
        )
    (repo / "Packages").write_text("\n".join(stanzas))
    return f"deb [trusted=yes] copy://{repo} ./"


def build_rootfs(
    root: Path,
    packages: list[str],
    suite: str,
    sources: tuple[str, str],
    work: Path,
    stubs: str | None = None,
) -> None:
    mirrors = []
    if sources[0]:
        (work / "host.sources").write_text(sources[0])
        mirrors.append(str(work / "host.sources"))
    if sources[1]:
        (work / "host.list").write_text(sources[1])
        mirrors.append(str(work / "host.list"))
    cmd = [
        "mmdebstrap",
        "--variant=essential",
        "--mode=root",
        "--format=directory",
        '--aptopt=APT::Install-Recommends "false"',
        "--include=" + ",".join([*BASE_PACKAGES, KERNEL_PACKAGE, *packages]),
        *[f"--dpkgopt=path-exclude={p}" for p in EXCLUDED_PATHS],
        "--dpkgopt=path-include=/usr/share/doc/*/copyright",
        suite,
        str(root),
        *mirrors,
        *([stubs] if stubs else []),
    ]
    stage("rootfs", "mmdebstrap " + ", ".join([*BASE_PACKAGES, KERNEL_PACKAGE, *packages]))
    run(cmd, stdout=subprocess.DEVNULL)


def take_kernel(root: Path, out: Path) -> tuple[str, Path]:
    kernels = sorted((root / "boot").glob("vmlinuz-*"))
    if not kernels:
        raise SystemExit(f"{KERNEL_PACKAGE} did not install a kernel into {root}/boot")
    version = kernels[-1].name.removeprefix("vmlinuz-")
    shutil.copy2(kernels[-1], out / "vmlinuz")
    modules = out.parent / "modules"
    shutil.copytree(root / "lib" / "modules" / version, modules, symlinks=True)
    for path in [root / "boot", root / "lib" / "modules"]:
        shutil.rmtree(path)
        path.mkdir()
    log(f"kernel: {version}")
    return version, modules


def install_overlay(root: Path) -> None:
    opt = root / "opt" / "kernelhost"
    opt.mkdir(parents=True, exist_ok=True)
    # The agent package (run as `python3 -m kernelhost_agent` from /opt/kernelhost), the kernel's
    # side files, and the two modules shared with the host, which the agent imports as the
    # top-level `codec` and `protocol` (kernelhost_agent/shared.py).
    package = opt / "kernelhost_agent"
    if package.exists():
        shutil.rmtree(package)
    shutil.copytree(
        HERE / "agent" / "kernelhost_agent", package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
    )
    for name in KERNEL_FILES:
        shutil.copy2(HERE / "agent" / name, opt / name)
    shutil.copy2(CODEC, opt / "codec.py")
    shutil.copy2(PROTOCOL, opt / "protocol.py")
    spec_dir = root / "usr" / "local" / "share" / "jupyter" / "kernels" / "kernelhost"
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                # IPython's history in the kernel's own memory, not in a database file: every
                # clone of a snapshot, and every fork, then holds a history of its own (a shared
                # file would give clones one session number: "Session/line number was not unique
                # in database"); the snapshot's warm-up cells store none
                "argv": [
                    "/usr/bin/python3",
                    "/opt/kernelhost/launch_kernel.py",
                    "-f",
                    "{connection_file}",
                    "--HistoryManager.hist_file=:memory:",
                ],
                "display_name": "Python 3 (kernelhost)",
                "language": "python",
                "interrupt_mode": "signal",
                "metadata": {"debugger": True},
            },
            indent=1,
        )
    )
    init = root / "sbin" / "kernelhost-init"
    shutil.copy2(HERE / "rootfs-init", init)
    init.chmod(0o755)
    (root / "etc" / "hostname").write_text("sandbox\n")
    (root / "etc" / "hosts").write_text("127.0.0.1 localhost sandbox\n::1 localhost\n")
    run(["chroot", str(root), "python3", "-m", "compileall", "-q", "/opt/kernelhost"])


def kernel_info(root: Path, template: str, spec: dict[str, Any]) -> dict[str, str]:
    """The kernel a template runs: the image's own Python kernelspec, or (``kernel`` in
    templates.json) an installed one, written to /etc/kernelhost/template.json for the agent
    (the file a template layer writes too: guest-image/layer.py)."""
    name = spec.get("kernel")
    if not name:
        return {"kernel": "kernelhost", "language": "python", "display_name": "Python 3 (kernelhost)"}
    found = [
        p
        for d in ("usr/local/share", "usr/share")
        if (p := root / d / "jupyter/kernels" / name / "kernel.json").is_file()
    ]
    if not found:
        raise SystemExit(f"templates.json: {template}: no kernelspec {name!r} was installed by its packages")
    kernelspec = json.loads(found[0].read_text())
    info = {
        "kernel": name,
        "language": str(spec.get("language") or kernelspec.get("language", name)).lower(),
        "display_name": str(kernelspec.get("display_name", name)),
    }
    path = root / "etc" / "kernelhost" / "template.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**info, "template": template, "env": {}, "preload": spec.get("preload", [])}))
    return info


def warm_up(root: Path, preload: list[str]) -> None:
    """Import the template's preloaded modules once at build time, as the guest's kernel will
    (HOME=/root), so caches they build on first use (matplotlib's font list) are in the image
    (and the agent copies them for a sandbox's user: kernelhost_agent/users.py)."""
    if not preload:
        return
    for module in preload:
        if not all(part.isidentifier() for part in module.split(".")):
            raise SystemExit(f"templates.json: preload entry {module!r} is not a module name")
    stage("warm-up", "import " + ", ".join(preload))
    env = ["HOME=/root", "PATH=/usr/bin:/bin", "LANG=C.UTF-8", "MPLBACKEND=Agg"]
    imports = "; ".join(f"import {m}" for m in preload)
    argv = ["chroot", str(root), "/usr/bin/env", "-i", *env, "python3", "-c", imports]
    run(argv, stdout=subprocess.DEVNULL)


def distribution_spec(suite: str) -> dict[str, Any]:
    """A bare base for templates on another release: the agent's packages and pip."""
    return {
        "description": f"Debian {suite}: the agent's packages and pip",
        "packages": ["python3-pip"],
        "suite": suite,
    }


def build(template: str, spec: dict[str, Any], image_dir: Path, force: bool) -> Path:
    suite = spec.get("suite") or codename()
    sources = sources_for(suite)
    key = image_key(template, spec, sources)
    final = image_dir / f"{template}-{key}"
    # a distribution base is no template of its own: its link is hidden from the service's list
    link = image_dir / (f".base-{template}" if spec.get("suite") else template)
    if (final / "manifest.json").exists() and not force:
        log(f"{template}: up to date ({final})")
        _point(link, final)
        return final
    global _BAR
    progress = _progress_module()
    if progress is None:
        return _build(template, spec, image_dir, suite, sources, key, final, link)
    # plain lines keep the "[image HH:MM:SS]" prefix of the rest of the log
    _BAR = progress.Stages(
        f"image {template}",
        STAGES,
        stream=sys.stdout,
        on_line=lambda line: print(f"[image {time.strftime('%H:%M:%S')}] {line}", flush=True),
    )
    try:
        with _BAR:
            return _build(template, spec, image_dir, suite, sources, key, final, link)
    finally:
        _BAR = None


def _build(
    template: str,
    spec: dict[str, Any],
    image_dir: Path,
    suite: str,
    sources: tuple[str, str],
    key: str,
    final: Path,
    link: Path,
) -> Path:
    image_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(image_dir, 0o755)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".build-{template}-", dir=image_dir))
    try:
        out = work / "out"
        out.mkdir()
        root = work / "rootfs"
        stubs = stub_repo(dict(spec.get("stub_packages", {})), work)
        build_rootfs(root, list(spec.get("packages", [])), suite, sources, work, stubs)
        stage("kernel", KERNEL_PACKAGE)
        kernel_version, modules = take_kernel(root, out)
        stage("overlay", "agent, codec, init, kernelspec")
        install_overlay(root)
        add_user(root, run)
        pip = install_wheels(root, list(spec.get("pip", [])), work, run, stage)
        kernel = kernel_info(root, template, spec)
        warm_up(root, list(spec.get("preload", [])))
        stage("erofs", "packing the root (lz4hc)")
        run(
            ["mkfs.erofs", "-zlz4hc", "--quiet", str(out / "rootfs.erofs"), str(root)],
            stdout=subprocess.DEVNULL,
        )
        stage("initramfs")
        names = build_initramfs(modules, out, work)
        log(f"initramfs: busybox + {len(names)} modules")
        packages = run(
            ["chroot", str(root), "dpkg-query", "-W", "-f=${Package} ${Version}\\n"],
            capture_output=True,
            text=True,
        ).stdout.split("\n")
        manifest = {
            "template": template,
            "key": key,
            "description": spec.get("description", ""),
            "preload": list(spec.get("preload", [])),
            **kernel,
            "kernel_version": kernel_version,
            "suite": suite,
            "arch": platform.machine(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - t0, 1),
            "sizes": {p.name: p.stat().st_size for p in out.iterdir()},
            "packages": [p for p in packages if p],
            "pip": pip,
        }
        (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for p in out.iterdir():
            p.chmod(0o644)
        out.chmod(0o755)
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    finally:
        # mmdebstrap stopped half-way leaves the host's /dev, /dev/shm, /proc and /sys mounted in
        # the root: removing the tree through them would empty the host's /dev/shm (every VM's
        # RAM file), so they go first
        unmount_all(work)
        shutil.rmtree(work, ignore_errors=True)
    _point(link, final)
    sizes = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in manifest["sizes"].items())
    log(f"{template}: built in {manifest['build_seconds']} s -> {final} ({sizes})")
    return final


def _point(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    tmp.symlink_to(target.name)
    tmp.replace(link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("templates", nargs="*", help="templates to build (default: all)")
    parser.add_argument("--image-dir", default=os.environ.get("KERNELHOST_IMAGE_DIR", DEFAULT_IMAGE_DIR))
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--print-path", action="store_true", help="print image dirs, build nothing")
    parser.add_argument(
        "--distribution", metavar="SUITE", help="build the base for templates on release SUITE (debian-SUITE)"
    )
    args = parser.parse_args()
    if args.distribution:
        if not re.fullmatch(r"[a-z]{3,20}", args.distribution):
            raise SystemExit(f"--distribution {args.distribution!r}: name a release, e.g. trixie")
        spec = distribution_spec(args.distribution)
        name = f"debian-{args.distribution}"
        if args.print_path:
            print(Path(args.image_dir) / f"{name}-{image_key(name, spec, sources_for(args.distribution))}")
        else:
            build(name, spec, Path(args.image_dir), args.force)
        return
    templates = load_templates()
    names = args.templates or list(templates)
    unknown = [n for n in names if n not in templates]
    if unknown:
        raise SystemExit(f"unknown template(s) {', '.join(unknown)}; valid: {', '.join(templates)}")
    if args.print_path:
        suite = codename()
        for n in names:
            print(Path(args.image_dir) / f"{n}-{image_key(n, templates[n], host_sources(suite))}")
        return
    if os.geteuid() != 0:
        raise SystemExit("building a guest image needs root (mmdebstrap --mode=root, chroot)")
    for n in names:
        build(n, templates[n], Path(args.image_dir), args.force)


if __name__ == "__main__":
    # stopped (make's SIGTERM, a CI timeout): unwind through the cleanups, as on Ctrl-C
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    main()
