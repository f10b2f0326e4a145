"""CPU partitions: one libvirt resource partition (a cgroup above its VMs' cgroups) per owner.

libvirt puts a domain whose XML names ``<resource><partition>/machine/NAME</partition>`` in
``machine/NAME.partition/`` of every cgroup hierarchy it uses (the ``.partition`` suffix is its
non-systemd layout); it does not create such a partition (the domain's start fails with "No
such file or directory"), so ``place`` makes it first, in every hierarchy where libvirt's
``machine`` partition is, with the parent's cpuset copied (an empty ``cpuset.cpus`` refuses
tasks) and the parent's controllers enabled (cgroup v2). Its CPU weight is ``cpu.shares`` on a
cgroup v1 hierarchy and ``cpu.weight`` on v2: siblings share a busy CPU by weight, so an
owner's VMs together get one owner's share however many of them are busy.

A domain's partition cannot change while it runs. ``move`` takes a running domain's threads
into another partition (a pooled VM handed to its owner): libvirt's cgroup of the domain is
copied (its sub-groups and CPU limits) under the new partition in the v1 CPU hierarchy and
every thread written to its ``tasks``. libvirt leaves them there (it places threads only when
it starts them) and removes its own, emptied, groups when the domain stops; the copy is
removed by ``release``. Other hierarchies (memory, cpuset) keep the domain where it started.
On a cgroup v2 host ``move`` is not offered (``can_move`` is False).

Names are the caller's (a safe identifier); nothing here knows whose they are. Blocking
filesystem calls: the service calls these through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import errno
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import HypervisorError

ROOT = Path("/sys/fs/cgroup")
MACHINE = "machine"
SUFFIX = ".partition"
V1_DEFAULT_SHARES = 1024  # cpu.shares of a v1 group that is given none (weight 100 on v2)
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,100}$")
# what a copied domain group takes of libvirt's (v1): its CPU limits
COPIED = ("cpu.shares", "cpu.cfs_period_us", "cpu.cfs_quota_us")


class PartitionsUnavailable(HypervisorError):
    """CPU partitions cannot be made on this host (the reason says why)."""


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup hierarchy that holds libvirt's ``machine`` partition."""

    machine: Path  # <mount>/machine
    v2: bool

    @property
    def weight_file(self) -> str | None:
        """The file that sets a group's CPU weight here (None: no CPU controller)."""
        name = "cpu.weight" if self.v2 else "cpu.shares"
        return name if (self.machine / name).exists() else None

    def path(self, name: str) -> Path:
        return self.machine / f"{name}{SUFFIX}"


def weight_value(weight: int, v2: bool) -> int:
    """``weight`` (1-10000, 100 the default, as cgroup v2's cpu.weight) in the hierarchy's unit."""
    return weight if v2 else max(2, weight * V1_DEFAULT_SHARES // 100)


def hierarchies(root: Path = ROOT) -> list[Hierarchy]:
    """The hierarchies under ``root`` where libvirt's ``machine`` partition exists now."""
    if (root / "cgroup.controllers").exists():  # a cgroup v2 host: one hierarchy
        return [Hierarchy(root / MACHINE, True)] if (root / MACHINE).is_dir() else []
    found: list[Hierarchy] = []
    seen: set[Path] = set()
    with contextlib.suppress(OSError):
        for mount in sorted(root.iterdir()):
            real = mount.resolve()
            if real in seen or not (mount / MACHINE).is_dir():
                continue  # a symlink to a co-mounted hierarchy (cpu -> cpu,cpuacct), or unused
            seen.add(real)
            found.append(Hierarchy(mount / MACHINE, (mount / "cgroup.controllers").exists()))
    return found


def _cpu_mount(root: Path) -> Path | None:
    """Where the CPU controller is mounted (the root itself on a v2 host)."""
    if (root / "cgroup.controllers").exists():
        return root if "cpu" in _read(root / "cgroup.controllers").split() else None
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        if (root / name / "cpu.shares").exists():
            return root / name
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


class Partitions:
    """The partitions of one service: ``place`` a domain before it starts, ``release`` it after
    it stopped; an owner's partition is made at its first domain and removed after its last."""

    def __init__(self, prefix: str, weight: int, root: Path = ROOT) -> None:
        if not 1 <= weight <= 10000:
            raise ValueError(f"a CPU weight is 1-10000, got {weight}")
        self.prefix = prefix
        self.weight = weight
        self.root = root
        self._lock = threading.Lock()
        # domain -> the partitions it has groups in: where it started, then where it was moved
        # (the last is where it counts)
        self._domains: dict[str, list[str]] = {}

    @classmethod
    def detect(cls, prefix: str, weight: int, root: Path = ROOT) -> Partitions:
        """Partitions on this host, or ``PartitionsUnavailable`` naming why there are none."""
        mount = _cpu_mount(root)
        if mount is None:
            raise PartitionsUnavailable(f"no cgroup CPU controller is mounted under {root}")
        where = mount / MACHINE if (mount / MACHINE).is_dir() else mount
        probe = where / f"{prefix}probe{SUFFIX}"
        try:
            probe.mkdir(exist_ok=True)
            probe.rmdir()
        except OSError as exc:
            raise PartitionsUnavailable(f"cannot make a cgroup in {where}: {exc.strerror or exc}") from exc
        return cls(prefix, weight, root)

    def name_for(self, owner: str | None) -> str:
        """The partition of ``owner`` (a safe identifier), or the service's own for None (pooled
        VMs, and what belongs to no key)."""
        if owner is None:
            return f"{self.prefix}service"
        if not NAME.fullmatch(owner):
            raise ValueError(f"a partition's owner must be a plain identifier, got {owner!r}")
        return f"{self.prefix}{owner}"

    @property
    def can_move(self) -> bool:
        return any(h.weight_file == "cpu.shares" for h in hierarchies(self.root))

    def place(self, domain: str, owner: str | None) -> str | None:
        """The partition (``/machine/NAME``) for ``domain``, made now if it is not there; None
        while libvirt has not made its ``machine`` partition (its first VM makes it)."""
        name = self.name_for(owner)
        found = hierarchies(self.root)
        if not any(h.weight_file for h in found):
            return None
        with self._lock:
            for h in found:
                self._make(h, name)
            where = self._domains.setdefault(domain, [])
            if name not in where:
                where.append(name)
        return f"/{MACHINE}/{name}"

    def _make(self, h: Hierarchy, name: str) -> None:
        path = h.path(name)
        try:
            path.mkdir()
        except FileExistsError:
            return
        except OSError as exc:
            raise HypervisorError(f"cannot make the CPU partition {path}: {exc}") from exc
        try:
            for f in ("cpuset.cpus", "cpuset.mems"):  # an empty cpuset takes no tasks
                if (h.machine / f).exists():
                    (path / f).write_text(_read(h.machine / f) + "\n")
            if h.v2:  # the controllers libvirt's groups below use
                enabled = _read(h.machine / "cgroup.subtree_control").split()
                if enabled:
                    (path / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in enabled))
            if h.weight_file is not None:
                (path / h.weight_file).write_text(f"{weight_value(self.weight, h.v2)}\n")
        except OSError as exc:
            with contextlib.suppress(OSError):
                rmdir(path)
            raise HypervisorError(f"cannot set up the CPU partition {path}: {exc}") from exc

    def move(self, domain: str, owner: str | None) -> bool:
        """Take the running ``domain``'s threads into ``owner``'s partition (v1 CPU hierarchy);
        False if there is nothing to move (v2, no partition, the domain not found)."""
        name = self.name_for(owner)
        with self._lock:
            where = self._domains.get(domain, [])
        old = where[-1] if where else None
        if old is None or old == name:
            return False
        h = next((h for h in hierarchies(self.root) if h.weight_file == "cpu.shares"), None)
        src = self._group_of(h.path(old), domain) if h is not None else None
        if h is None or src is None:
            return False
        self.place(domain, owner)
        try:
            _copy_group(src, h.path(name) / src.name)
        except OSError as exc:
            raise HypervisorError(f"cannot move domain {domain!r} to {name}: {exc}") from exc
        return True

    @staticmethod
    def _group_of(partition: Path, domain: str) -> Path | None:
        """libvirt's group of ``domain`` in ``partition`` (``qemu-N-<domain>.libvirt-qemu``)."""
        return next(iter(partition.glob(f"*-{domain}.libvirt-qemu")), None)

    def release(self, domain: str) -> None:
        """After ``domain`` stopped: its copied group goes, and its partition if it was the
        partition's last domain (idempotent)."""
        with self._lock:
            names = self._domains.pop(domain, [])
        for name in names:
            for h in hierarchies(self.root):
                group = self._group_of(h.path(name), domain)
                if group is not None:  # a copy; libvirt removed its own (a live one stays)
                    _remove_tree(group)
            self._prune(name)

    def _prune(self, name: str) -> bool:
        """Remove partition ``name`` if no domain of this service is in it; whether it is gone."""
        with self._lock:
            if any(name in names for names in self._domains.values()):
                return False
            gone = True
            for h in hierarchies(self.root):
                path = h.path(name)
                try:
                    rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    if exc.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        raise HypervisorError(f"cannot remove the CPU partition {path}: {exc}") from exc
                    gone = False
            return gone

    def adopt(self) -> list[str]:
        """At service start: the domains found in this service's partitions (a previous run's,
        still running) count there again; empty partitions are removed. The names removed."""
        removed = []
        for name in self.on_disk():
            for h in hierarchies(self.root):
                for group in h.path(name).glob("*.libvirt-qemu"):
                    domain = group.name.removesuffix(".libvirt-qemu").split("-", 2)[-1]
                    with self._lock:
                        where = self._domains.setdefault(domain, [])
                        if name not in where:
                            where.append(name)
            if self._prune(name):
                removed.append(name)
        return removed

    def on_disk(self) -> list[str]:
        """This service's partitions that exist now, by name."""
        names: set[str] = set()
        for h in hierarchies(self.root):
            names |= {p.name.removesuffix(SUFFIX) for p in h.machine.glob(f"{self.prefix}*{SUFFIX}")}
        return sorted(names)

    def owners(self) -> dict[str, str]:
        """Each placed domain's partition name (for tests and the operator)."""
        with self._lock:
            return {domain: names[-1] for domain, names in self._domains.items()}

    def close(self) -> list[str]:
        """At service stop: remove every partition of this service with no domain left."""
        return [name for name in self.on_disk() if self._prune(name)]


def _copy_group(src: Path, dst: Path) -> None:
    """Copy libvirt's v1 group ``src`` (and its sub-groups) to ``dst`` with its CPU limits, then
    move each thread into its copy."""
    groups = [src, *sorted(p for p in src.rglob("*") if p.is_dir())]
    for group in groups:
        target = dst / group.relative_to(src)
        target.mkdir(exist_ok=True)
        for f in COPIED:
            value = _read(group / f)
            if value:
                (target / f).write_text(value + "\n")
    for group in groups:
        target = dst / group.relative_to(src)
        for tid in _read(group / "tasks").split():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                (target / "tasks").write_text(tid + "\n")


def _remove_tree(group: Path) -> None:
    """Remove an emptied group and its sub-groups, deepest first (cgroupfs: rmdir only)."""
    for sub in sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        with contextlib.suppress(OSError):
            rmdir(sub)
    with contextlib.suppress(OSError):
        rmdir(group)


def rmdir(path: Path) -> None:
    """Remove a cgroup: its control files go with it; EBUSY while it holds tasks (the tests
    put another in its place, for a plain directory standing in for cgroupfs)."""
    path.rmdir()
