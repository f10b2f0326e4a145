#!/usr/bin/env python3
"""Build a template's layer INSIDE the throwaway build VM (never on the host): apt and pip
packages, files, setup commands, the kernel and its warm-up, in a chroot over the VM's own root
disk, packed as one erofs the guest stacks over the image's root.

    python3 layer.py --spec JOB.json --out-dev /dev/vdX [--files FILES.tar.gz] [--root-dev /dev/vda]

The host (kernelhost/sandboxes/template_vm.py) boots the base image with an empty writable disk
(``--out-dev``), uploads this file, ``buildroot.py``, the job and the tenant's files archive over
the agent channel, and runs this script as a bash command. ``JOB.json`` is the template spec in
its canonical form (kernelhost/templates/spec.py) plus ``pip_config`` (the guest's pip index options,
served through the VM's allowlist proxy), ``proxy_env`` and ``kernel_packages`` (what the chosen
kernel needs), ``max_members`` and ``max_file_bytes`` (the archive's caps). The work tree lives
on a tmpfs of the VM's RAM. Progress goes to stdout as JSON lines: ``{"stage": ..., "detail":
...}``, ``{"log": ...}`` and, last, ``{"done": info}`` (kernel, language, what apt and pip
resolved, ``layer_bytes``) or ``{"error": ..., "stage": ...}``. The layer is written to the
start of ``--out-dev``; the host reads ``layer_bytes`` of it as opaque bytes, under a cap, and
parses ``info`` as untrusted JSON.

Standard library only: it runs on the guest image's Python.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from buildroot import BuildRoot, remove_build_litter  # noqa: E402

STAGES = ["mount", "apt", "pip", "files", "setup", "kernel", "warm-up", "pack"]
#: unpacks the files archive (stdin) INSIDE the chroot, so that its destination and every member
#: path resolve in the layer's root (a symlink such as /var/run -> /run stays in the layer); it
#: checks each member as it streams (count, total size, relative paths, files and directories
#: only), so a small archive of a million members stops at the cap without being held
EXTRACT = r"""
import os, sys, tarfile
dest, max_members, max_bytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(dest, exist_ok=True)
count = total = 0
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|gz") as archive:
    for m in archive:
        count += 1
        if count > max_members:
            sys.exit(f"files: the archive has more than {max_members} members; pack fewer files")
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or not m.name.strip("./"):
            sys.exit(f"files: member {m.name[:200]!r} leaves the archive; use relative paths")
        if not (m.isfile() or m.isdir()):
            sys.exit(f"files: member {m.name[:200]!r} is not a regular file or a directory")
        total += m.size
        if total > max_bytes:
            sys.exit(f"files: the archive unpacks to more than {max_bytes} bytes; pack less")
        target = os.path.join(dest, m.name)
        if m.isdir():
            os.makedirs(target, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
        src = archive.extractfile(m)
        with src, open(target, "wb") as out:
            while chunk := src.read(1 << 20):
                out.write(chunk)
        os.chmod(target, 0o755 if m.mode & 0o111 else 0o644)
print(f"{count} members, {total} bytes")
"""
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KERNEL_DIRS = ("usr/local/share/jupyter/kernels", "usr/share/jupyter/kernels")
PYTHON_KERNELSPEC = "kernelhost"  # the image's own (guest-image/build.py)
TEMPLATE_FILE = "etc/kernelhost/template.json"  # what the agent reads at start
PIP_CERT = "/tmp/kh-pip-cert.pem"  # in the root while it builds (its /tmp is emptied before packing)


class StepFailed(Exception):
    """A build step failed; the message names the step and what to fix."""


_STAGE = ["mount"]  # the stage being run, named by a failure


def emit(**event: Any) -> None:
    if "stage" in event:
        _STAGE[0] = event["stage"]
    print(json.dumps(event), flush=True)


def stream(
    root: BuildRoot, argv: list[str], env: dict[str, str], cwd: str = "/", stdin: Path | None = None
) -> tuple[int, list[str]]:
    """Run ``argv`` in the root, each output line logged; (exit code, the last 200 lines)."""
    proc = root.chroot(argv, env, cwd, stdin)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        emit(log=line)
        tail = [*tail[-199:], line]
    return proc.wait(), tail


def base_env(spec: dict[str, Any]) -> dict[str, str]:
    """The steps' environment: the spec's, and the proxy through which the VM reaches the
    package indexes of its allowlist (the host checks every connection)."""
    return {
        "PATH": PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        **{str(k): str(v) for k, v in spec.get("proxy_env", {}).items()},
        **spec["env"],
    }


# -- steps ---------------------------------------------------------------------------------------


def step_apt(root: BuildRoot, packages: list[str], env: dict[str, str]) -> None:
    if not packages:
        return
    emit(stage="apt", detail=", ".join(packages))
    proxy = [f"-oAcquire::{p}::Proxy={env[p + '_proxy']}" for p in ("http", "https") if env.get(p + "_proxy")]
    code, tail = stream(root, ["apt-get", "-q", "update", "-o", "Acquire::Retries=3", *proxy], env)
    if code:
        raise StepFailed(f"apt: could not read the package lists: {_last_error(tail)}")
    argv = [
        "apt-get",
        "-q",
        "-y",
        "install",
        "--no-install-recommends",
        "-o",
        "Acquire::Retries=3",
        *proxy,
        *packages,
    ]
    code, tail = stream(root, argv, env)
    if code:
        raise StepFailed("apt: " + _apt_error(tail))
    stream(root, ["apt-get", "clean"], env)


def _apt_error(tail: list[str]) -> str:
    text = "\n".join(tail)
    m = re.search(r"Unable to locate package (\S+)", text)
    if m:
        return f"no package named {m.group(1)!r} in the distribution; check its name (apt-cache search)"
    m = re.search(r"Package '?([^' ]+)'? has no installation candidate", text)
    if m:
        return f"package {m.group(1)!r} has no installation candidate"
    m = re.search(r"Version '([^']+)' for '([^']+)' was not found", text)
    if m:
        return f"version {m.group(1)!r} of {m.group(2)!r} was not found"
    return _last_error(tail)


def step_pip(
    root: BuildRoot, requirements: list[str], pip_config: dict[str, Any], env: dict[str, str]
) -> None:
    if not requirements:
        return
    emit(stage="pip", detail=", ".join(requirements))
    pip_env = {
        **env,
        **{
            f"PIP_{k.upper().replace('-', '_')}": " ".join(v) if isinstance(v, list) else str(v)
            for k, v in pip_config.items()
            if v
        },
    }
    argv = [
        "python3", "-m", "pip", "install", "--no-cache-dir", "--break-system-packages",
        "--root-user-action=ignore", "--disable-pip-version-check", "--no-input", "--progress-bar=off",
        *requirements,
    ]  # fmt: skip
    code, tail = stream(root, argv, pip_env)
    if code:
        raise StepFailed("pip: " + _pip_error(tail))


def _pip_error(tail: list[str]) -> str:
    text = "\n".join(tail)
    m = re.search(r"No matching distribution found for (\S+)", text)
    if m:
        name = m.group(1)
        return f"no matching distribution for {name!r} on the package index; check its name and version"
    m = re.search(r"Could not find a version that satisfies the requirement (\S+)", text)
    if m:
        return f"no version satisfies {m.group(1)!r}"
    if re.search(r"ResolutionImpossible|conflicting dependencies", text):
        return "the requirements conflict: " + _last_error(tail)
    return _last_error(tail)


def step_files(root: BuildRoot, files: Path | None, dest: str, spec: dict[str, Any]) -> None:
    """Unpack the tenant's archive at ``dest`` inside the chroot (``EXTRACT``)."""
    if files is None:
        return
    emit(stage="files", detail=dest)
    caps = [str(int(spec.get("max_members", 100_000))), str(int(spec.get("max_file_bytes", 1 << 28)))]
    argv = ["python3", "-c", EXTRACT, dest, *caps]
    code, tail = stream(root, argv, {"PATH": PATH, "LANG": "C.UTF-8"}, stdin=files)
    if code:
        raise StepFailed(_last_error(tail) if tail else f"files: unpacking failed with exit code {code}")


def step_setup(root: BuildRoot, commands: list[str], env: dict[str, str]) -> None:
    for n, command in enumerate(commands):
        emit(stage="setup", detail=f"[{n}] {command[:120]}")
        code, tail = stream(root, ["/bin/sh", "-ec", command], env, cwd="/home/user")
        if code:
            short = command if len(command) <= 80 else command[:77] + "..."
            raise StepFailed(f"setup[{n}] ({short!r}) failed with exit code {code}: {_last_error(tail)}")


def step_home(root: BuildRoot) -> None:
    """What the files, setup and warm-up left in ``/home/user`` becomes the account ``user``'s
    (guest-image/account.py), where the image has it: an E2B sandbox runs its code as ``user``,
    which must be able to change its own home. Symbolic links are changed, never followed."""
    script = "if id -u user >/dev/null 2>&1; then chown -R -h user:user /home/user; fi"
    code, tail = stream(root, ["/bin/sh", "-ec", script], {"PATH": PATH, "LANG": "C.UTF-8"})
    if code:
        raise StepFailed(f"setup: giving /home/user to user failed: {_last_error(tail)}")


def step_kernel(root: BuildRoot, spec: dict[str, Any]) -> dict[str, Any]:
    """Find the kernelspec the template runs and write what the agent reads at start."""
    name = {"python": PYTHON_KERNELSPEC, "r": "ir", "bash": "bash"}.get(spec["kernel"], spec["kernel"])
    emit(stage="kernel", detail=name)
    found = {}
    for d in KERNEL_DIRS:
        for k in sorted((root.path / d).glob("*/kernel.json")):
            found.setdefault(k.parent.name, k)
    if name not in found:
        raise StepFailed(
            f"kernel: no kernelspec named {name!r} in the image (found: {', '.join(found) or 'none'}); "
            "install it with apt, pip or a setup command"
        )
    kernelspec = json.loads(found[name].read_text())
    info = {
        "template": spec["name"],
        "kernel": name,
        "language": str(kernelspec.get("language", spec["kernel"])).lower(),
        "display_name": kernelspec.get("display_name", name),
        "env": spec["env"],
        "preload": spec["preload"],
    }
    path = root.path / TEMPLATE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=1))
    return info


def step_warm_up(root: BuildRoot, info: dict[str, Any], env: dict[str, str]) -> None:
    """Load the preloads once at build time, so caches they fill on first use are in the layer
    (and a misspelled module fails the build, not the first sandbox)."""
    preload = info["preload"]
    if not preload:
        return
    emit(stage="warm-up", detail=", ".join(preload))
    if info["language"] == "r":
        argv = ["Rscript", "-e", "; ".join(f"library({m})" for m in preload)]
    else:
        argv = ["python3", "-c", "; ".join(f"import {m}" for m in preload)]
    code, tail = stream(root, argv, {**env, "MPLBACKEND": "Agg"}, cwd="/home/user")
    if code:
        raise StepFailed(f"preload: {_last_error(tail)}")


def resolved(root: BuildRoot, env: dict[str, str], before: dict[str, str]) -> dict[str, Any]:
    """What apt and pip actually installed: packages new or changed against the base."""
    after = dpkg_versions(root)
    apt = {k: v for k, v in after.items() if before.get(k) != v}
    out = subprocess.run(
        ["chroot", str(root.path), "/usr/bin/env", "-i", *[f"{k}={v}" for k, v in env.items()],
         "python3", "-c", LIST_DISTRIBUTIONS, _site_packages(root)],
        capture_output=True, text=True,
    )  # fmt: skip
    listed = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    pip = {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"] for p in listed}  # canonical names
    return {"apt": dict(sorted(apt.items())), "pip": dict(sorted(pip.items()))}


#: what ``pip list --path`` says, without pip's own start-up (seconds under emulation)
LIST_DISTRIBUTIONS = (
    "import importlib.metadata as m, json, sys; "
    "print(json.dumps([{'name': d.metadata['Name'], 'version': d.version} "
    "for d in m.distributions(path=[sys.argv[1]]) if d.metadata['Name']]))"
)


def dpkg_versions(root: BuildRoot) -> dict[str, str]:
    out = subprocess.run(
        ["chroot", str(root.path), "dpkg-query", "-W", "-f=${Package} ${Version}\\n"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)


def _site_packages(root: BuildRoot) -> str:
    found = sorted((root.path / "usr/local/lib").glob("python3*/dist-packages"))
    return "/" + str(found[-1].relative_to(root.path)) if found else "/usr/local/lib/python3/dist-packages"


def _last_error(tail: list[str]) -> str:
    lines = [ln.strip() for ln in tail if ln.strip()]
    errors = [ln for ln in lines if re.match(r"^(E:|ERROR:|Error|error:)", ln)]
    text = (errors or lines or ["no output"])[-1]
    return text[:300]


# -- the build ----------------------------------------------------------------------------------


def build(
    root_dev: Path, spec: dict[str, Any], files: Path | None, out_dev: Path, work: Path
) -> dict[str, Any]:
    t0 = time.monotonic()
    env = base_env(spec)
    kernel_packages = spec.get("kernel_packages", {})
    emit(stage="mount", detail=str(root_dev))
    with BuildRoot(root_dev, work / "build") as root:
        if spec.get("pip_cert"):  # the certificates the host's pip trusts, for pip in setup too
            shutil.copyfile(spec["pip_cert"], root.path / PIP_CERT.lstrip("/"))
            env["PIP_CERT"] = PIP_CERT
        before = dpkg_versions(root)
        step_apt(root, [*kernel_packages.get("apt", []), *spec["apt"]], env)
        step_pip(root, [*kernel_packages.get("pip", []), *spec["pip"]], spec.get("pip_config", {}), env)
        step_files(root, files, spec.get("files_dest") or "/home/user", spec)
        step_setup(root, [*kernel_packages.get("setup", []), *spec["setup"]], env)
        info = step_kernel(root, spec)
        step_warm_up(root, info, env)
        step_home(root)
        versions = resolved(root, env, before)
    remove_build_litter(root.upper)
    emit(stage="pack", detail="erofs (lz4hc)")
    layer = work / "layer.erofs"
    subprocess.run(
        ["mkfs.erofs", "-zlz4hc", "--quiet", str(layer), str(root.upper)],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    size = layer.stat().st_size
    with layer.open("rb") as src, out_dev.open("r+b") as dst:
        if size > dst.seek(0, os.SEEK_END):
            raise StepFailed(f"pack: the layer is {size >> 20} MiB, over the {dst.tell() >> 20} MiB cap")
        dst.seek(0)
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    return {
        **info,
        "resolved": versions,
        "build_seconds": round(time.monotonic() - t0, 1),
        "layer_bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", required=True, type=Path, help="the job, as JSON")
    parser.add_argument("--files", type=Path, help="the files archive (tar.gz) to unpack at files_dest")
    parser.add_argument("--out-dev", required=True, type=Path, help="the disk the layer is written to")
    parser.add_argument("--root-dev", type=Path, default=Path("/dev/vda"), help="the base image's root")
    parser.add_argument("--work", type=Path, default=Path("/run/kh-build/work"), help="scratch (a tmpfs)")
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    args.work.mkdir(parents=True, exist_ok=True)
    try:
        size = spec.get("work_size", "80%")
        subprocess.run(["busybox", "mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs",
                        str(args.work)], check=True, capture_output=True)  # fmt: skip
        info = build(args.root_dev, spec, args.files, args.out_dev, args.work)
    except StepFailed as exc:
        emit(error=str(exc), stage=_STAGE[0])
        raise SystemExit(1) from None
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (
            exc.stderr.decode(errors="replace").strip()
            if isinstance(getattr(exc, "stderr", None), bytes)
            else ""
        )
        emit(error=f"{_STAGE[0]}: {exc}" + (f": {detail[:300]}" if detail else ""), stage=_STAGE[0])
        raise SystemExit(1) from None
    emit(done=info)


if __name__ == "__main__":
    main()
