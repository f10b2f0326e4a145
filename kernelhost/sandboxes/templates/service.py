"""Templates as the sandbox layer serves them: which a key may use, building a spec into an
image and its snapshot off the request path, and removing one nobody uses.

Three kinds, looked up in this order when a key names a template: its own (built through the
API; other keys never see it), the operator's (spec files in ``template_dir``, built at start,
visible to every key), the built-ins (``make image``). A template's image is
``<image_dir>/<image>`` (``Settings.built_image_dir``: QEMU must read it, beside its base)
where ``image`` is the name for the
operator's and ``name@<key id>`` for a key's own; sandboxes record that image name. A build
runs the stages of ``builds.py`` and then makes the template's snapshot (its preloads
imported); only then does the template's link move to the new build, so sandboxes keep starting
from the last good build while a new one runs or after it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import secrets
import shutil
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import structlog

from hypervisor import GuestImage, ImageNotFound

from ...archive import ArchiveError, local_files, pack_files
from ..context import Context
from ..errors import (
    CapacityExceeded,
    InvalidRequest,
    Remedy,
    SandboxError,
    TemplateConflict,
    TemplateNotFound,
    UnknownTemplate,
)
from ..network.indexes import BuildIndexes
from ..store.templates import TemplateRecord, TemplateStore
from .build_vm import SCRIPTS
from .builds import GUEST_IMAGE, Build, BuildFailed, BuildQueue, BuildState, clean_work
from .spec import SpecError, TemplateSpec, parse_spec
from .views import KERNEL_PACKAGES, TemplateView, builtin_view, image_name, template_view

log = structlog.get_logger("kernelhost.templates")

LAYER_FORMAT = 2  # bump when what goes into a layer's key changes (2: built in a build VM)
GZIP_MAGIC = b"\x1f\x8b"


class TemplateService:
    def __init__(self, ctx: Context, store: TemplateStore) -> None:
        self.ctx = ctx
        self.store = store
        settings = ctx.settings
        self.queue = BuildQueue(
            settings.state_dir / "template-builds",
            settings.template_build_concurrency,
            settings.template_build_timeout,
        )
        self.files_dir = settings.state_dir / "template-files"  # archives of builds under way
        self.indexes = BuildIndexes(ctx.network.host)

    def start(self) -> None:
        """After a restart: builds that were running are failed (their scratch is gone with the
        prune of abandoned builds), and finished ones are known again (their logs stay)."""
        for row in self.store.unfinished_builds():
            row.update(state=str(BuildState.FAILED), error="the service stopped during the build",
                       finished_at=time.time())  # fmt: skip
            self.store.put_build(row)
            rec = self.store.get(row["owner"], row["name"])
            if rec is not None and rec.build_id == row["id"]:
                rec.state, rec.error = ("ready" if self._image(rec) else "failed"), row["error"]
                self.store.put(rec)
        for rec in self.store.all():
            for row in self.store.builds(rec.owner, rec.name):
                self.queue.restore(row)
        stale = time.time() - self.ctx.settings.template_build_timeout - 300
        for scratch in self.ctx.settings.built_image_dir.glob(".build-*"):
            # a layer build that a killed service left (past any build's deadline: another
            # service sharing the image directory may be building in a younger one)
            with contextlib.suppress(OSError):
                if scratch.stat().st_mtime < stale:
                    clean_work(scratch)
        clean_work(self.files_dir)  # archives of builds that a killed service left

    # -- what a key sees -------------------------------------------------------------------------

    def builtins(self) -> list[str]:
        """Full images (``make image``): neither a layer nor a key's or operator's template."""
        names = []
        for name in self.ctx.images.templates():
            if "@" in name or name.startswith("."):
                continue
            with contextlib.suppress(ImageNotFound):
                if not self.ctx.images.get(name).layers and self.store.get("", name) is None:
                    names.append(name)
        return names

    def visible(self, owner: str) -> list[TemplateView]:
        views = {name: builtin_view(self.ctx.images.get(name)) for name in self.builtins()}
        for rec in self.store.all():
            if rec.owner in ("", owner):
                views[rec.name] = template_view(rec, self._image(rec), self.queue.builds.get(rec.build_id))
        return [views[n] for n in sorted(views)]

    def health(self) -> dict[str, object]:
        """Every key may see this: the built-ins' and operator's templates by name with their
        state, the API keys' own only counted by state."""
        keys: dict[str, int] = {}
        for rec in self.store.all():
            if rec.owner:
                keys[rec.state] = keys.get(rec.state, 0) + 1
        return {"states": {v.name: str(v.state) for v in self.visible("")}, "keys": keys}

    def view(self, owner: str, name: str) -> TemplateView:
        for view in self.visible(owner):
            if view.name == name:
                return view
        raise TemplateNotFound(name, [v.name for v in self.visible(owner)])

    def builds_of(self, owner: str, name: str) -> list[dict[str, Any]]:
        """The builds of a template ``owner`` may see, oldest first, without whose they are (a
        built-in has none)."""
        view = self.view(owner, name)
        if view.kind == "builtin":
            return []
        rec = self.store.get(owner, name) or self.store.get("", name)
        assert rec is not None
        return [
            {k: v for k, v in row.items() if k not in ("owner", "key")}
            for row in self.store.builds(rec.owner, name)
        ]

    def resolve(self, owner: str, name: str) -> tuple[str, GuestImage]:
        """The image a new sandbox of ``name`` starts from, and the image's name to record."""
        rec = self._record(owner, name)
        if rec is None:
            if name in self.builtins():
                return name, self.ctx.images.get(name)
            raise UnknownTemplate(
                f"unknown template {name!r}; valid templates: "
                f"{', '.join(v.name for v in self.visible(owner)) or 'none built (run make image)'}",
                field="template",
                valid=[v.name for v in self.visible(owner)],
            )
        image = self._image(rec)
        if image is None:
            what = (
                "is still building" if rec.state == "building" else f"has no successful build ({rec.error})"
            )
            raise TemplateConflict(
                f"template {name!r} {what}; wait for its build or fix its spec", template=name
            )
        return image_name(rec.owner, rec.name), image

    def _record(self, owner: str, name: str) -> TemplateRecord | None:
        return self.store.get(owner, name) or self.store.get("", name)

    def _image(self, rec: TemplateRecord) -> GuestImage | None:
        if not rec.image_key:
            return None
        try:
            image = self.ctx.images.get(image_name(rec.owner, rec.name))
        except ImageNotFound:
            return None
        return image if image.complete else None

    # -- building --------------------------------------------------------------------------------

    def parse(self, data: Any) -> TemplateSpec:
        """A spec as a request or spec file gives it, checked (``InvalidRequest`` naming the
        field): its base must be a built-in, its name must not be one."""
        try:
            return parse_spec(data, builtins=tuple(self.builtins()))
        except SpecError as exc:
            raise InvalidRequest(str(exc), field=exc.field) from None

    async def submit(self, owner: str, spec: TemplateSpec, archive: bytes | None = None) -> Build:
        """Build a checked spec (``parse``) in the background (a cache hit finishes at once)."""
        current = self.store.get(owner, spec.name)
        running = self.queue.builds.get(current.build_id) if current else None
        if running is not None and not running.state.finished:
            raise TemplateConflict(
                f"template {spec.name!r} is being built ({running.id}); wait for it or cancel it first",
                template=spec.name,
                build_id=running.id,
            )
        self._check_limits(owner, spec)
        base = await self._base(spec)
        files = None
        if archive:
            spec, files = await asyncio.to_thread(self._stage, spec, archive)
        key = self._key(spec, base)
        build = self.queue.new(owner, spec.name, key)
        rec = current or TemplateRecord(owner, spec.name, spec.wire(), "building")
        rec.spec, rec.state, rec.build_id, rec.error = spec.wire(), "building", build.id, ""
        self.store.put(rec)
        self.store.put_build(build.row())
        build.task = self.ctx.tasks.spawn(
            self._build(build, rec, spec, base, files), name=f"template-build:{build.id}"
        )
        return build

    def _stage(self, spec: TemplateSpec, archive: bytes) -> tuple[TemplateSpec, Path]:
        """Keep the tenant's archive as opaque bytes until its build VM takes it (the host never
        opens it: its members are checked and unpacked in that VM); only its size and gzip
        header are checked here. Removed when the build ends."""
        if not archive.startswith(GZIP_MAGIC):
            raise InvalidRequest(
                "files: the archive is not gzip-compressed; send a tar.gz (the SDK and the CLI "
                "pack one: kernelhost.archive.pack_files)",
                field="files",
            )
        digest = hashlib.sha256(archive).hexdigest()
        self.files_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.files_dir / f"{digest}-{secrets.token_hex(4)}.tar.gz"
        path.write_bytes(archive)
        return spec.with_files(digest), path

    def _check_limits(self, owner: str, spec: TemplateSpec) -> None:
        """A template's shape within its owner's limits; its builds within the key's places."""
        settings = self.ctx.settings
        memory = max(spec.memory_mib or 0, settings.template_build_memory_mib)
        if memory > settings.max_memory_mib_per_key:
            raise CapacityExceeded(
                f"template {spec.name!r} needs {memory} MiB of VM memory (its memory_mib, or a build "
                f"VM's template_build_memory_mib), over this key's limit of "
                f"{settings.max_memory_mib_per_key} MiB (max_memory_mib_per_key); lower memory_mib",
                limit="max_memory_mib_per_key",
                value=settings.max_memory_mib_per_key,
            )
        cpus = max(os.cpu_count() or 1, settings.vm_vcpus)
        if spec.vcpus is not None and spec.vcpus > cpus:
            raise InvalidRequest(
                f"vcpus: {spec.vcpus} is more than this host's {cpus} CPUs; ask for at most {cpus}",
                field="vcpus",
            )
        held = [r.name for r in self.store.all() if r.owner == owner]
        if owner and spec.name not in held and len(held) >= settings.max_templates_per_key:
            raise CapacityExceeded(
                f"this API key holds {len(held)} templates, its limit (max_templates_per_key "
                f"{settings.max_templates_per_key}); delete one first",
                limit="max_templates_per_key",
                value=settings.max_templates_per_key,
            )
        mine = [b for b in self.queue.builds.values() if b.owner == owner and not b.state.finished]
        if len(mine) >= settings.max_template_builds_per_key:
            raise CapacityExceeded(
                f"this API key has {len(mine)} template builds queued or running, its limit "
                f"(max_template_builds_per_key {settings.max_template_builds_per_key}); wait for "
                "one to finish or cancel it",
                limit="max_template_builds_per_key",
                value=settings.max_template_builds_per_key,
            )

    async def _base(self, spec: TemplateSpec) -> tuple[str, str]:
        """(the base's image directory name, its key) for a spec; a distribution base may not
        be built yet (its first build makes it)."""
        if spec.suite is not None:
            image_dir = str(self.ctx.settings.image_dir)
            script = str(GUEST_IMAGE / "build.py")
            out = await _script_output(
                [
                    sys.executable,
                    script,
                    "--print-path",
                    "--distribution",
                    spec.suite,
                    "--image-dir",
                    image_dir,
                ]
            )
            name = Path(out.strip()).name
            return name, name.rsplit("-", 1)[1]
        image = self.ctx.images.get(spec.base)
        return image.path.name, image.key

    def _key(self, spec: TemplateSpec, base: tuple[str, str]) -> str:
        scripts = b"".join((GUEST_IMAGE / f).read_bytes() for f in SCRIPTS)
        blob = json.dumps([LAYER_FORMAT, spec.wire(), base[1], KERNEL_PACKAGES.get(spec.kernel, {})])
        return hashlib.sha256(blob.encode() + hashlib.sha256(scripts).digest()).hexdigest()[:16]

    async def _build(
        self, build: Build, rec: TemplateRecord, spec: TemplateSpec, base: tuple[str, str], files: Path | None
    ) -> None:
        from .stages import run_build  # the stages, in a module of their own

        bound = log.bind(template=spec.name, build_id=build.id, owner=rec.owner or "operator")
        bound.info("template.build_started", key=build.key)
        try:
            _, cached = await run_build(self.ctx, self.queue, self.indexes, build, rec, spec, base, files)
            rec.state, rec.image_key, rec.error = "ready", build.key, ""
            await build.finish(BuildState.CACHED if cached else BuildState.SUCCEEDED)
            bound.info("template.built", seconds=round(time.time() - build.created_at, 1))
        except BuildFailed as exc:
            said = str(exc)
            rec.state = "failed"
            rec.error = said if not exc.stage or said.startswith(f"{exc.stage}:") else f"{exc.stage}: {said}"
            await build.finish(BuildState.FAILED, rec.error)
            bound.warning("template.build_failed", stage=exc.stage, error=str(exc))
        except SandboxError as exc:  # a limit of the key (its memory, while the build's VMs run)
            rec.state, rec.error = "failed", f"{build.stage or 'build'}: {exc}"
            await build.finish(BuildState.FAILED, rec.error)
            bound.warning("template.build_refused", stage=build.stage, error=str(exc))
        except (OSError, ValueError) as exc:  # the host's side failed: the build fails, said so
            rec.state = "failed"
            rec.error = f"{build.stage or 'build'}: the service could not run the build: {exc}"
            await build.finish(BuildState.FAILED, rec.error)
            bound.exception("template.build_error", stage=build.stage)
        except asyncio.CancelledError:
            rec.state, rec.error = ("ready" if self._image(rec) else "failed"), "the build was cancelled"
            await build.finish(BuildState.CANCELLED, rec.error)
            bound.info("template.build_cancelled")
            raise
        finally:
            if files is not None:
                files.unlink(missing_ok=True)
            if self.store.get(rec.owner, rec.name) is not None:  # not deleted meanwhile
                self.store.put(rec)
            self.store.put_build(build.row())

    async def cancel(self, owner: str, name: str, build_id: str | None = None) -> Build:
        build = self.build(owner, name, build_id)
        if build.task is not None and not build.task.done():
            build.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                async with asyncio.timeout(60):
                    await asyncio.shield(build.task)
        return build

    def build(self, owner: str, name: str, build_id: str | None = None) -> Build:
        """One build of the caller's own template (the latest by default). The operator's
        templates' builds (owner "") are the operator's: a key neither reads their logs nor
        cancels them (404, as for another key's)."""
        rec = self.store.get(owner, name)
        if rec is None:
            raise TemplateNotFound(name, [v.name for v in self.visible(owner)])
        wanted = build_id or rec.build_id
        build = self.queue.builds.get(wanted)
        if build is None or build.owner != rec.owner or build.name != rec.name:
            raise TemplateNotFound(name, [v.name for v in self.visible(owner)], build_id=wanted)
        return build

    # -- removing --------------------------------------------------------------------------------

    async def delete(self, owner: str, name: str) -> None:
        rec = self.store.get(owner, name)
        if rec is None:
            if self._record(owner, name) is not None or name in self.builtins():
                raise TemplateConflict(f"template {name!r} is not this key's; only its owner can delete it",
                                       template=name)  # fmt: skip
            raise TemplateNotFound(name, [v.name for v in self.visible(owner)])
        image = image_name(owner, name)
        users = [s.id for s in self.ctx.registry if s.record.template == image]
        if users:
            raise TemplateConflict(
                f"template {name!r} is used by {len(users)} sandbox(es) ({', '.join(users[:5])}); "
                "delete them first",
                template=name,
                remedy=Remedy.LIST_SANDBOXES,
                sandboxes=users,
            )
        if rec.build_id:
            with contextlib.suppress(TemplateNotFound):
                await self.cancel(owner, name, rec.build_id)
        self.store.delete(owner, name)
        await self.ctx.vms.forget_template(image)
        await asyncio.to_thread(self._remove_files, image, rec)
        log.info("template.deleted", template=name, owner=owner or "operator")

    def _remove_files(self, image: str, rec: TemplateRecord) -> None:
        built_dir = self.ctx.settings.built_image_dir
        (built_dir / image).unlink(missing_ok=True)
        for path in built_dir.glob(f"{image}-*"):
            shutil.rmtree(path, ignore_errors=True)
        for build in self.store.builds(rec.owner, rec.name):
            (self.queue.log_dir / f"{build['id']}.jsonl").unlink(missing_ok=True)


async def _script_output(argv: list[str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    if proc.returncode:
        raise InvalidRequest(f"base: {err.decode(errors='replace').strip()[:300]}", field="base")
    return out.decode()


class OperatorTemplates:
    """The operator's spec files (``template_dir/*.toml``), built at start for every key."""

    def __init__(self, service: TemplateService) -> None:
        self.service = service

    async def load(self) -> None:
        directory = self.service.ctx.settings.template_dir
        if not directory.is_dir():
            return
        for path in sorted(directory.glob("*.toml")):
            try:
                data = tomllib.loads(path.read_text())
                archive = _operator_files(path, data)
                build = await self.service.submit("", self.service.parse(data), archive)
            except (OSError, tomllib.TOMLDecodeError, SandboxError, ArchiveError) as exc:
                log.error("template.operator_spec_failed", path=str(path), error=str(exc))
                continue
            log.info("template.operator_spec", path=str(path), template=build.name, build_id=build.id)


def _operator_files(path: Path, data: dict[str, Any]) -> bytes | None:
    """A spec file's ``files`` (local paths, relative to the file) as an archive."""
    entries = local_files(data.pop("files", None), path.parent)
    if entries:
        data["files_dest"] = "/"
    return pack_files(entries) if entries else None
