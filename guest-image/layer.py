#!/usr/bin/env python3
"""Build a template's layer over a built image: apt and pip packages, files, setup commands,
the kernel and its warm-up, packed as one erofs the guest stacks over the image's root.

    python3 guest-image/layer.py --base DIR --spec SPEC.json --out DIR [--files DIR] [--work DIR]

``SPEC.json`` is a template spec in its canonical form (kernelhost/templates/spec.py) plus
``pip_config`` (the index options of the host's pip) and ``kernel_packages`` (what the chosen
kernel needs). Progress goes to stdout as JSON lines: ``{"stage": ..., "detail": ...}``,
``{"log": ...}`` and, last, ``{"done": manifest}`` or ``{"error": ..., "stage": ...}``. The
output directory holds ``layer.erofs`` and ``manifest.json`` (what apt and pip resolved); on
failure nothing is left of the work directory, and no mount.

Standard library only, like build.py.
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

from buildroot import BuildRoot, remove_build_litter, unmount_all  # noqa: E402

STAGES = ["mount", "apt", "pip", "files", "setup", "kernel", "warm-up", "pack"]
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KERNEL_DIRS = ("usr/local/share/jupyter/kernels", "usr/share/jupyter/kernels")
PYTHON_KERNELSPEC = "kernelhost"  # the image's own (guest-image/build.py)
TEMPLATE_FILE = "etc/kernelhost/template.json"  # what the agent reads at start


class StepFailed(Exception):
    """A build step failed; the message names the step and what to fix."""


_STAGE = ["mount"]  # the stage being run, named by a failure


def emit(**event: Any) -> None:
    if "stage" in event:
        _STAGE[0] = event["stage"]
    print(json.dumps(event), flush=True)


def stream(root: BuildRoot, argv: list[str], env: dict[str, str], cwd: str = "/") -> tuple[int, list[str]]:
    """Run ``argv`` in the root, each output line logged; (exit code, the last 200 lines)."""
    proc = root.chroot(argv, env, cwd)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        emit(log=line)
        tail = [*tail[-199:], line]
    return proc.wait(), tail


def base_env(spec: dict[str, Any]) -> dict[str, str]:
    return {
        "PATH": PATH,
        "HOME": "/root",
        "LANG": "C.UTF-8",
        "DEBIAN_FRONTEND": "noninteractive",
        **spec["env"],
    }


# -- steps ---------------------------------------------------------------------------------------


def step_apt(root: BuildRoot, packages: list[str], env: dict[str, str]) -> None:
    if not packages:
        return
    emit(stage="apt", detail=", ".join(packages))
    code, tail = stream(root, ["apt-get", "-q", "update", "-o", "Acquire::Retries=3"], env)
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
    root: BuildRoot, requirements: list[str], pip_config: dict[str, str], env: dict[str, str]
) -> None:
    if not requirements:
        return
    emit(stage="pip", detail=", ".join(requirements))
    pip_env = {**env, **{f"PIP_{k.upper().replace('-', '_')}": v for k, v in pip_config.items()}}
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


def step_files(root: BuildRoot, files: Path | None, dest: str) -> None:
    if files is None or not any(files.iterdir()):
        return
    emit(stage="files", detail=dest)
    target = root.path / dest.lstrip("/")
    target.mkdir(parents=True, exist_ok=True)
    subprocess.run(["cp", "-a", "--no-preserve=ownership", f"{files}/.", str(target)], check=True)


def step_setup(root: BuildRoot, commands: list[str], env: dict[str, str]) -> None:
    for n, command in enumerate(commands):
        emit(stage="setup", detail=f"[{n}] {command[:120]}")
        code, tail = stream(root, ["/bin/sh", "-ec", command], env, cwd="/home/user")
        if code:
            short = command if len(command) <= 80 else command[:77] + "..."
            raise StepFailed(f"setup[{n}] ({short!r}) failed with exit code {code}: {_last_error(tail)}")


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
         "python3", "-m", "pip", "list", "--format=json", "--disable-pip-version-check",
         "--path", _site_packages(root)],
        capture_output=True, text=True,
    )  # fmt: skip
    listed = json.loads(out.stdout or "[]") if out.returncode == 0 else []
    pip = {re.sub(r"[-_.]+", "-", p["name"]).lower(): p["version"] for p in listed}  # canonical names
    return {"apt": dict(sorted(apt.items())), "pip": dict(sorted(pip.items()))}


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


def build(base: Path, spec: dict[str, Any], files: Path | None, out: Path, work: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    env = base_env(spec)
    binds = [p for p in spec.get("pip_binds", []) if isinstance(p, str)]
    emit(stage="mount", detail=base.name)
    with BuildRoot(base / "rootfs.erofs", work, binds) as root:
        before = dpkg_versions(root)
        step_apt(root, [*spec.get("kernel_packages", {}).get("apt", []), *spec["apt"]], env)
        step_pip(
            root,
            [*spec.get("kernel_packages", {}).get("pip", []), *spec["pip"]],
            spec.get("pip_config", {}),
            env,
        )
        step_files(root, files, spec.get("files_dest") or "/home/user")
        step_setup(root, [*spec.get("kernel_packages", {}).get("setup", []), *spec["setup"]], env)
        info = step_kernel(root, spec)
        step_warm_up(root, info, env)
        versions = resolved(root, env, before)
    remove_build_litter(root.upper)
    emit(stage="pack", detail="erofs (lz4hc)")
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mkfs.erofs", "-zlz4hc", "--quiet", str(out / "layer.erofs"), str(root.upper)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    return {
        **info,
        "resolved": versions,
        "build_seconds": round(time.monotonic() - t0, 1),
        "layer_bytes": (out / "layer.erofs").stat().st_size,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, type=Path, help="the built image to build over")
    parser.add_argument("--spec", required=True, type=Path, help="the spec, as JSON")
    parser.add_argument("--files", type=Path, help="a directory to copy to files_dest")
    parser.add_argument("--out", required=True, type=Path, help="where layer.erofs goes")
    parser.add_argument("--work", type=Path, help="scratch directory (default: next to --out)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("building a template layer needs root (mount, chroot)")
    spec = json.loads(args.spec.read_text())
    work = args.work or args.out.with_name(args.out.name + ".work")
    try:
        work.mkdir(parents=True)
        info = build(args.base, spec, args.files, args.out, work)
    except StepFailed as exc:
        emit(error=str(exc), stage=_STAGE[0])
        shutil.rmtree(args.out, ignore_errors=True)
        raise SystemExit(1) from None
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (
            exc.stderr.decode(errors="replace").strip()
            if isinstance(getattr(exc, "stderr", None), bytes)
            else ""
        )
        emit(error=f"{_STAGE[0]}: {exc}" + (f": {detail[:300]}" if detail else ""), stage=_STAGE[0])
        shutil.rmtree(args.out, ignore_errors=True)
        raise SystemExit(1) from None
    finally:
        unmount_all(work)
        shutil.rmtree(work, ignore_errors=True)
    emit(done=info)


if __name__ == "__main__":
    main()
