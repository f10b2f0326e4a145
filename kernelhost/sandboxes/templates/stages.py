"""The stages of one template build: a distribution base when the spec names one (the
operator's bootstrap, on the host), the layer (built in a build VM: ``build_vm.py``), the
manifest, the snapshot with the preloads imported, and only then the template's link moved to
the new build. Whatever ends a build, its scratch directory goes (its files archive with it);
a build that fails leaves no image of itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from hypervisor import GuestImage, HypervisorError
from hypervisor.ownership import qemu_ids

from ...channel import ChannelError
from ..context import Context
from ..network.indexes import BuildIndexes
from ..store.templates import TemplateRecord
from .build_vm import build_in_vm
from .builds import GUEST_IMAGE, Build, BuildFailed, BuildQueue, clean_work
from .spec import TemplateSpec
from .views import KERNEL_PACKAGES, image_name

#: modes of what a build leaves: the layer readable by QEMU's group only, the manifest (env
#: values, setup commands) by root only
LAYER_MODE, MANIFEST_MODE, IMAGE_DIR_MODE = 0o640, 0o600, 0o750


async def run_build(
    ctx: Context,
    queue: BuildQueue,
    indexes: BuildIndexes,
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
        image = await _layer(ctx, queue, indexes, build, rec, spec, base, files, final)
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
    await queue.run_script(build, argv, expect_done=False)


async def _layer(
    ctx: Context,
    queue: BuildQueue,
    indexes: BuildIndexes,
    build: Build,
    rec: TemplateRecord,
    spec: TemplateSpec,
    base: tuple[str, str],
    files: Path | None,
    final: Path,
) -> GuestImage:
    """The layer, built in a build VM of the base (``files``: the tenant's archive, handed to
    that VM unopened)."""
    scratch = final.parent / f".build-{final.name}-{build.id}"
    scratch.mkdir(parents=True)
    try:
        base_dir = ctx.settings.image_dir / base[0]
        base_image = GuestImage(base[0], base_dir, json.loads((base_dir / "manifest.json").read_text()))
        job = {**spec.wire(), "kernel_packages": KERNEL_PACKAGES.get(spec.kernel, {}),
               "max_members": ctx.settings.template_files_max_members,
               "max_file_bytes": ctx.settings.max_file_bytes}  # fmt: skip
        info, layer = await queue.run(
            build, lambda: build_in_vm(ctx, indexes, build, base_image, job, files, scratch)
        )
        manifest = _manifest(rec, spec, base, build, info)
        await asyncio.to_thread(_install, scratch, layer, manifest, final)
    finally:
        await asyncio.shield(asyncio.to_thread(clean_work, scratch))
    return GuestImage(image_name(rec.owner, rec.name), final, manifest, ctx.settings.image_dir)


def _install(scratch: Path, layer: Path, manifest: dict[str, Any], final: Path) -> None:
    """``final``: the layer (root's, readable by QEMU's group) and the manifest (root's only)."""
    out = scratch / "out"
    out.mkdir(mode=IMAGE_DIR_MODE)
    layer.rename(out / "layer.erofs")
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    (out / "manifest.json").chmod(MANIFEST_MODE)
    ids = qemu_ids()  # QEMU reads the layer through its group
    for path, mode in ((out / "layer.erofs", LAYER_MODE), (out, IMAGE_DIR_MODE)):
        if ids is not None:
            os.chown(path, 0, ids[1])
        path.chmod(mode)
    shutil.rmtree(final, ignore_errors=True)
    out.rename(final)


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
    memory, _ = ctx.vms.shape_of(image)
    try:
        with ctx.registry.reserve(build.owner, 0, memory):  # the template VM is the key's too
            await ctx.vms.prepare_template(image)
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
