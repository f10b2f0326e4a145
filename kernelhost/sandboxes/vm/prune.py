"""Pruning of stale build artifacts: template snapshots in the RAM dir, guest image builds.

Every image rebuild leaves the previous ``<template>-<key>/`` build in the image dir (~180-400
MiB each), and every image rebuild, QEMU/libvirt upgrade or change of VM size leaves a template
snapshot in the RAM dir (``templates/<template>-<shape>-<key>/``: a RAM file of up to the VM's
memory, in tmpfs, so in RAM). What is safe to remove, from how they are used:

- A snapshot is needed only to start clones: a clone maps its RAM file privately and loads its
  device state once, at start. Nothing else reads it: a wake loads a full saved state into
  fresh memory, a fork copies the running parent, a replaced VM clones the *current* snapshot.
  So a hibernated sandbox never needs one, and a sandbox record (which names an image build,
  not a snapshot) does not keep one. A snapshot is stale when its image build is not the current
  build of its template (or the template is gone), when its key no longer matches (QEMU or
  libvirt upgraded), or when it is unreadable. Snapshots of another VM shape are kept when
  current: another service on this host may run with that shape.
  A stale snapshot whose RAM file a running VM still maps (a clone started from it) is kept:
  unlinking it would be safe for that VM but would free nothing until it exits, and the bytes
  reported freed would be false; the next prune after those clones end removes it. So is one
  with a file in ``pins/``: a checkpoint's pages were diffed against its RAM, and restoring the
  checkpoint maps it again (``vm/saves.py``).
- An image build is needed by every VM started from it (QEMU keeps its root file open), by
  every sandbox record that names it (a wake or a fork of that sandbox starts a VM from exactly
  that build) and by every checkpoint record that names it (a restore or a branch loads the
  checkpoint into a VM of that build; a kept checkpoint, E2B's snapshot, outlives its sandbox's
  record). It is stale when it is no template's current build, no record of this service names
  it, and no running process has one of its files open or mapped.

Service start-up prunes snapshots (``prune_snapshots``); ``kernelhost prune`` prunes both, with
``--dry-run`` to list only. Services that share a RAM dir must share the image dir, since
"current" is read from the image dir's ``<template>`` links.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from hypervisor import ImageNotFound, ImageStore

from .snapshots import snapshot_key

ABANDONED_BUILD_SECONDS = 3600  # a ".build-*" directory this old belongs to no running build


@dataclass(frozen=True)
class Artifact:
    kind: str  # "snapshot" or "image"
    path: Path
    bytes: int  # space it holds (allocated blocks: a RAM file holds only the pages written)
    reason: str  # why it is stale


@dataclass
class Plan:
    remove: list[Artifact] = field(default_factory=list)
    keep: list[tuple[Artifact, str]] = field(default_factory=list)  # stale, kept: and why

    @property
    def bytes(self) -> int:
        return sum(a.bytes for a in self.remove)

    def __add__(self, other: Plan) -> Plan:
        return Plan(self.remove + other.remove, self.keep + other.keep)


def allocated_bytes(path: Path) -> int:
    """Bytes ``path`` (a file or a tree) occupies on its filesystem."""
    try:
        if path.is_symlink() or path.is_file():
            return path.lstat().st_blocks * 512
        total = 0
        for root, _dirs, files in os.walk(path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:
                    pass
        return total
    except OSError:
        return 0


@dataclass
class InUse:
    """Files that running processes have mapped or open (``/proc/*/maps`` and ``/proc/*/fd``).

    ``uncertain`` names a QEMU process this one may not inspect (not root): then nothing a VM
    could use counts as unused."""

    paths: set[str] = field(default_factory=set)
    uncertain: str = ""

    def holds(self, path: Path) -> bool:
        if self.uncertain:
            return True
        prefix = str(path).rstrip("/") + "/"
        return str(path) in self.paths or any(p.startswith(prefix) for p in self.paths)


def scan_in_use(proc: Path = Path("/proc")) -> InUse:
    found = InUse()
    for entry in proc.iterdir() if proc.is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            maps = (entry / "maps").read_text(errors="replace")
            fds = []
            for fd in list((entry / "fd").iterdir()):
                try:
                    fds.append(os.readlink(fd))
                except OSError:  # closed meanwhile (the listing's own descriptor, say)
                    continue
        except PermissionError:
            try:
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith("qemu") and not found.uncertain:
                found.uncertain = f"cannot inspect {comm} (pid {entry.name}); run as root"
            continue
        except OSError:  # exited meanwhile
            continue
        for line in maps.splitlines():
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith("/"):
                found.paths.add(parts[5].removesuffix(" (deleted)"))
        found.paths.update(fd for fd in fds if fd.startswith("/"))
    return found


def _current_images(images: ImageStore) -> dict[str, str]:
    """template -> key of its current build (what ``<image_dir>/<template>`` points at)."""
    current = {}
    for template in images.templates():
        try:
            current[template] = images.get(template).key
        except (ImageNotFound, OSError, ValueError):  # a link that broke meanwhile
            continue
    return current


def stale_snapshots(
    ram_dir: Path, images: ImageStore, in_use: InUse, versions: dict[str, str] | None = None
) -> Plan:
    """Snapshots in ``ram_dir/templates`` that no clone will start from again.

    ``versions`` (``Hypervisor.versions()``) also makes snapshots of other QEMU or libvirt
    versions stale; without it only the image build decides."""
    plan = Plan()
    base = ram_dir / "templates"
    if not base.is_dir():
        return plan
    current = _current_images(images)
    for path in sorted(base.iterdir()):
        if path.name.startswith(".build-"):
            reason = _abandoned(path)
            if reason:
                plan.remove.append(Artifact("snapshot", path, allocated_bytes(path), reason))
            continue
        if path.name.startswith(".") or not path.is_dir():
            continue
        reason = _snapshot_staleness(path, current, versions)
        if not reason:
            continue
        art = Artifact("snapshot", path, allocated_bytes(path), reason)
        pins = path / "pins"
        if pins.is_dir() and any(pins.iterdir()):
            plan.keep.append((art, "checkpoints were taken over it (pins/)"))
        elif in_use.holds(path):
            plan.keep.append((art, in_use.uncertain or "mapped by a running VM (a clone of it)"))
        else:
            plan.remove.append(art)
    return plan


def _abandoned(path: Path) -> str:
    try:
        age = time.time() - path.stat().st_mtime
    except OSError:
        return ""
    return "abandoned build" if age > ABANDONED_BUILD_SECONDS else ""


def _snapshot_staleness(path: Path, current: dict[str, str], versions: dict[str, str] | None) -> str:
    try:
        meta = json.loads((path / "meta.json").read_text())
        template, image_key = str(meta["template"]), str(meta["image_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return "unreadable (no valid meta.json)"
    if template not in current:
        return f"template {template!r} has no built image"
    if image_key != current[template]:
        return f"made from image {template}-{image_key}; current is {template}-{current[template]}"
    if versions is not None:
        try:
            key = snapshot_key(
                image_key, versions, int(meta["memory_mib"]), int(meta["vcpus"]), str(meta["accel"])
            )
        except (KeyError, TypeError, ValueError):
            return "unreadable (incomplete meta.json)"
        if not path.name.endswith("-" + key):
            return "made by another QEMU or libvirt version"
    return ""


BY_SANDBOX = "named by a sandbox record (a wake or fork needs it)"
BY_CHECKPOINT = "named by a checkpoint (a restore or a branch from it needs it)"


class Reference(NamedTuple):
    """An image build a record of the service names, and why that keeps it."""

    template: str
    image_key: str
    why: str = BY_SANDBOX


def referenced_builds(db_path: Path) -> list[Reference]:
    """The builds the sandbox and checkpoint records of the service database at ``db_path``
    name (sandboxes first)."""
    if not db_path.is_file():
        return []
    from ..store.checkpoints import CheckpointStore
    from ..store.sandboxes import Store

    store = Store(db_path)
    try:
        refs = [Reference(r.template, r.image_key) for r in store.all()]
        checkpoints = CheckpointStore(store.db).all()
        return refs + [Reference(c.template, c.image_key, BY_CHECKPOINT) for c in checkpoints]
    finally:
        store.close()


def stale_images(images: ImageStore, referenced: Iterable[tuple[str, ...]], in_use: InUse) -> Plan:
    """Image builds in the image and built dirs that no template links to, no record names
    (``referenced``: (template, image_key[, why]), as ``referenced_builds`` gives them) and no
    running process uses."""
    plan = Plan()
    current = {f"{t}-{k}" for t, k in _current_images(images).items()}
    used: dict[str, str] = {}
    for ref in referenced:
        used.setdefault(f"{ref[0]}-{ref[1]}", ref[2] if len(ref) > 2 else BY_SANDBOX)
    roots = [root for root in images.roots if root.is_dir()]
    for root in roots:
        for link in root.iterdir():  # also links of templates whose manifest is missing
            if link.is_symlink():
                current.add(os.readlink(link).rstrip("/").rsplit("/", 1)[-1])
    for root in roots:
        for path in sorted(root.iterdir()):
            if not path.is_symlink() and path.is_dir():
                _judge_image(plan, path, current, used, in_use)
    _keep_bases(plan, roots)
    return plan


def _judge_image(plan: Plan, path: Path, current: set[str], used: dict[str, str], in_use: InUse) -> None:
    if path.name.startswith(".build-"):
        reason = _abandoned(path)
        if reason and not in_use.holds(path):
            plan.remove.append(Artifact("image", path, allocated_bytes(path), reason))
        return
    if path.name.startswith(".") or path.name in current:
        return
    art = Artifact("image", path, allocated_bytes(path), "not the current build of a template")
    if path.name in used:
        plan.keep.append((art, used[path.name]))
    elif in_use.holds(path):
        plan.keep.append((art, in_use.uncertain or "in use by a running VM"))
    else:
        plan.remove.append(art)


def _keep_bases(plan: Plan, roots: Iterable[Path]) -> None:
    """A template's layer boots its base's build: a base that a kept layer names is kept."""
    removed = {art.path for art in plan.remove}
    needed: dict[str, str] = {}
    for path in (path for root in roots for path in root.iterdir()):
        if path.is_symlink() or path in removed or not (path / "layer.erofs").is_file():
            continue
        try:
            needed[str(json.loads((path / "manifest.json").read_text())["base"])] = path.name
        except (OSError, ValueError, KeyError, TypeError):
            continue
    for art in list(plan.remove):
        if art.path.name in needed:
            plan.remove.remove(art)
            plan.keep.append((art, f"the base of the template layer {needed[art.path.name]}"))


def apply(plan: Plan, on_removed: Callable[[Artifact], None] | None = None) -> int:
    """Remove what the plan says; returns the bytes freed."""
    freed = 0
    for art in plan.remove:
        try:
            shutil.rmtree(art.path)
        except FileNotFoundError:
            continue  # another service pruned it meanwhile
        except OSError:
            shutil.rmtree(art.path, ignore_errors=True)
            if art.path.exists():
                continue
        freed += art.bytes
        if on_removed is not None:
            on_removed(art)
    return freed
