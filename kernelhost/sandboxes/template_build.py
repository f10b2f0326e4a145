"""The stages of one template build: a distribution base when the spec names one, the layer
(``guest-image/layer.py``), the manifest, the snapshot with the preloads imported, and only then
the template's link moved to the new build. Whatever ends a build, its scratch directory goes
(and with it any mount of it); a build that fails leaves no image of itself.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hypervisor import GuestImage, HypervisorError

from ..channel import ChannelError
from ..pipconfig import build_pip_options
from ..templates import TemplateSpec
from ..templates.builds import GUEST_IMAGE, Build, BuildFailed, BuildQueue, clean_work
from .context import Context
from .template_store import TemplateRecord
from .template_views import KERNEL_PACKAGES, image_name


async def run_build(
    ctx: Context,
    queue: BuildQueue,
    build: Build,
    rec: TemplateRecord,
    spec: TemplateSpec,
    base: tuple[str, str],
    files: Path | None,
) -> tuple[GuestImage, bool]:
    """Build ``spec`` into the image of ``rec``: the image, and whether it was built before (a
    cache hit). Raises ``BuildFailed`` naming the stage."""
    image_dir, built_dir = ctx.settings.image_dir, ctx.settings.built_image_dir
    name = image_name(rec.owner, rec.name)
    final = built_dir / f"{name}-{build.key}"
    cached = (final / "manifest.json").is_file()
    if cached:
        await build.note(
            {"stage": "cached", "detail": f"{final.name} (the spec and its inputs are unchanged)"}
        )
        image = GuestImage(name, final, json.loads((final / "manifest.json").read_text()))
    else:
        if spec.suite is not None and not (image_dir / base[0] / "manifest.json").is_file():
            await _distribution_base(queue, build, spec.suite, image_dir)
        image = await _layer(ctx, queue, build, rec, spec, base, files, final)
    try:
        await _snapshot(ctx, build, image)
    except BaseException:
        if not cached:
            await asyncio.shield(asyncio.to_thread(shutil.rmtree, final, True))
        raise
    await asyncio.to_thread(_point, built_dir / name, final)
    return image, cached


async def _distribution_base(queue: BuildQueue, build: Build, suite: str, image_dir: Path) -> None:
    await build.note({"stage": "base", "detail": f"Debian {suite}: bootstrap, kernel, agent"})
    argv = [
        sys.executable,
        str(GUEST_IMAGE / "build.py"),
        "--distribution",
        suite,
        "--image-dir",
        str(image_dir),
    ]
    await queue.run_script(build, argv, work=None, expect_done=False)


async def _layer(
    ctx: Context,
    queue: BuildQueue,
    build: Build,
    rec: TemplateRecord,
    spec: TemplateSpec,
    base: tuple[str, str],
    files: Path | None,
    final: Path,
) -> GuestImage:
    scratch = final.parent / f".build-{final.name}-{build.id}"
    scratch.mkdir(parents=True)
    try:
        pip_options, binds = build_pip_options()
        job = {
            **spec.wire(),
            "pip_config": pip_options,
            "pip_binds": binds,
            "kernel_packages": KERNEL_PACKAGES.get(spec.kernel, {}),
        }
        (scratch / "spec.json").write_text(json.dumps(job))
        base_dir = ctx.settings.image_dir / base[0]
        argv = [
            sys.executable, str(GUEST_IMAGE / "layer.py"), "--base", str(base_dir),
            "--spec", str(scratch / "spec.json"), "--out", str(scratch / "out"),
            "--work", str(scratch / "work"),
        ]  # fmt: skip
        if files is not None:
            argv += ["--files", str(files)]
        info = await queue.run_script(build, argv, work=scratch / "work")
        manifest = _manifest(rec, spec, base, build, info)
        (scratch / "out" / "manifest.json").write_text(json.dumps(manifest, indent=1))
        for path in (scratch / "out").iterdir():
            path.chmod(0o644)
        (scratch / "out").chmod(0o755)
        shutil.rmtree(final, ignore_errors=True)
        (scratch / "out").rename(final)
    finally:
        await asyncio.shield(asyncio.to_thread(clean_work, scratch))
    return GuestImage(image_name(rec.owner, rec.name), final, manifest, ctx.settings.image_dir)


def _manifest(
    rec: TemplateRecord, spec: TemplateSpec, base: tuple[str, str], build: Build, info: dict[str, Any]
) -> dict[str, Any]:
    return {
        "template": image_name(rec.owner, rec.name),
        "name": rec.name,
        "owner": rec.owner,
        "key": build.key,
        "base": base[0],
        "base_template": spec.base,
        "description": spec.description,
        "preload": list(spec.preload),
        "kernel": info.get("kernel"),
        "language": info.get("language"),
        "display_name": info.get("display_name"),
        "vm": {
            k: v
            for k, v in (
                ("memory_mib", spec.memory_mib),
                ("vcpus", spec.vcpus),
                ("writable_mib", spec.writable_mib),
            )
            if v is not None
        },
        "network": {"mode": spec.network, "allow": list(spec.allow)} if spec.network else None,
        "resolved": info.get("resolved", {}),
        "spec": spec.wire(),
        "build_id": build.id,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": info.get("build_seconds"),
        "sizes": {"layer.erofs": info.get("layer_bytes")},
    }


async def _snapshot(ctx: Context, build: Build, image: GuestImage) -> None:
    """The template's snapshot, its preloads imported, as the built-ins have (a first sandbox
    then clones it at once); a kernel that does not start fails the build here, not later."""
    if not ctx.vms.use_snapshots:
        return
    await build.note(
        {"stage": "snapshot", "detail": ", ".join(image.manifest.get("preload") or []) or "kernel"}
    )
    try:
        await ctx.vms.snapshot_for(image)
    except (HypervisorError, ChannelError, TimeoutError) as exc:
        raise BuildFailed(
            "the template's VM did not reach a ready kernel with its preloads imported: "
            f"{exc or type(exc).__name__}",
            "snapshot",
        ) from None


def _point(link: Path, target: Path) -> None:
    tmp = link.with_name(f".{link.name}.tmp")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target.name)
    tmp.replace(link)
