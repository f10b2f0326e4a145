"""A running VM's RAM copied by its changed pages, for a fork.

A clone maps its base RAM file (a template's, or an earlier fork's) privately: every page it
never wrote is still the file's page, and every page it wrote is an anonymous copy in QEMU's
process. ``/proc/PID/pagemap`` tells the two apart (present and not a file page: written), so a
fork's RAM file is the base file's data plus the written pages read from ``/proc/PID/mem``: the
cost grows with what the parent changed, not with the VM's RAM. The base part does not change
while the VM runs, so it can be copied before the VM is paused; only the written pages are read
while it is.

The devices' state comes from QEMU's ``xen-save-devices-state`` (every section but RAM) and is
given the configuration section a migration stream starts with (``device_stream``): loaded with
``migrate-incoming`` into a VM that maps the fork's RAM file privately, it gives back the parent.

Linux only, and root (or CAP_SYS_ADMIN and ptrace rights over QEMU): otherwise ``PageForkUnavailable``
and the caller copies the RAM the slow way. No libvirt here: the caller pauses and resumes.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import HypervisorError
from .ramdiff import MAGIC, PAGE, VERSION, VM_CONFIGURATION

_PRESENT = 1 << 63
_SWAPPED = 1 << 62
_FILE = 1 << 61
_MAGIC_VERSION = MAGIC.to_bytes(4, "big") + VERSION.to_bytes(4, "big")
_CHUNK = 1 << 20  # bytes read from /proc/PID/mem and written to the file at a time
# 1 for each value of an entry's last byte (bits 56-63) that says "the process's own page"
_OWN = bytes(1 if b << 56 & (_PRESENT | _SWAPPED) and not b << 56 & _FILE else 0 for b in range(256))
_RUN = re.compile(b"\x01+")


class PageForkUnavailable(HypervisorError):
    """The VM's RAM cannot be copied page by page here (shared RAM, no access to QEMU's memory)."""


@dataclass(frozen=True)
class RamMapping:
    """Where QEMU maps a VM's RAM file, privately, and the file's name (``path``: None once
    it was removed, as an earlier fork's file is)."""

    pid: int
    start: int
    end: int
    path: str | None = None

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def map_file(self) -> str:
        """The mapped file, reachable even when its name is gone (an earlier fork's file)."""
        return f"/proc/{self.pid}/map_files/{self.start:x}-{self.end:x}"


def find_ram(pid: int, size: int, proc: Path = Path("/proc")) -> RamMapping:
    """The private file mapping of ``size`` bytes in process ``pid``: the VM's RAM."""
    try:
        maps = (proc / str(pid) / "maps").read_text()
    except OSError as exc:
        raise PageForkUnavailable(f"cannot read the mappings of QEMU (pid {pid}): {exc}") from exc
    found = []
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        if hi - lo == size and parts[1].startswith("rw"):
            path = None if parts[5].endswith(" (deleted)") else parts[5]
            found.append((parts[1], RamMapping(pid, lo, hi, path)))
    if len(found) != 1:
        raise PageForkUnavailable(f"QEMU (pid {pid}) maps {len(found)} files of {size} bytes, not one")
    perms, mapping = found[0]
    if perms[3] != "p":
        raise PageForkUnavailable("the VM's RAM is mapped shared: it has no base file to share")
    return mapping


def written_runs(pagemap: bytes | bytearray) -> list[tuple[int, int]]:
    """(first page, page count) of each run of pages that are the process's own (written):
    present or swapped, and not the file's page. ``pagemap``: 8 bytes a page (little-endian;
    the three flags are in each entry's last byte). Found by C code (``translate`` and a regex),
    not a Python loop: a 512 MiB VM has 131072 entries, and this runs while the VM is paused."""
    own = bytes(pagemap[7::8]).translate(_OWN)
    return [(m.start(), m.end() - m.start()) for m in _RUN.finditer(own)]


def make_ram_file(path: Path, size: int) -> None:
    """An empty (all holes) RAM file of ``size`` bytes at ``path``, new."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def copy_base(source: str | Path, dest: Path) -> int:
    """Copy the data of the RAM file ``source`` (a path, or a ``RamMapping.map_file``) into
    ``dest`` (made by ``make_ram_file``): its holes stay holes, which on tmpfs read as zeros as
    in the source. Returns the bytes copied."""
    try:
        src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PageForkUnavailable(f"cannot open the VM's RAM file: {exc}") from exc
    try:
        dst = os.open(dest, os.O_RDWR | os.O_CLOEXEC)
        try:
            return _copy_data(src, dst, os.fstat(dst).st_size)
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _copy_data(src: int, dst: int, size: int) -> int:
    copied = 0
    pos = 0
    while pos < size:
        try:
            pos = os.lseek(src, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: no data past pos
            break
        end = min(os.lseek(src, pos, os.SEEK_HOLE), size)
        while pos < end:
            n = os.copy_file_range(src, dst, end - pos, pos, pos)
            if n <= 0:
                raise OSError(f"copying the base RAM stopped at byte {pos}")
            pos += n
            copied += n
    return copied


def _pagemap_runs(mapping: RamMapping) -> list[tuple[int, int]]:
    pages = mapping.size // PAGE
    try:
        with open(f"/proc/{mapping.pid}/pagemap", "rb", buffering=0) as f:
            table = os.pread(f.fileno(), pages * 8, mapping.start // PAGE * 8)
    except OSError as exc:
        raise PageForkUnavailable(f"cannot read QEMU's page table: {exc}") from exc
    if len(table) != pages * 8:
        raise PageForkUnavailable("QEMU's page table ended early")
    return written_runs(table)


def allocate_written(mapping: RamMapping, dest: Path) -> int:
    """Allocate, in ``dest``, the pages the (running) process owns in ``mapping`` now: the
    copy that follows, while it is paused, then writes into pages that exist (on tmpfs about
    half the time of a write that allocates). It changes no data (``fallocate`` fills holes
    only), so a page the process gives back before the copy costs nothing but its room.
    Returns the bytes allocated; 0 where the filesystem cannot allocate ahead."""
    runs = _pagemap_runs(mapping)
    fd = os.open(dest, os.O_RDWR | os.O_CLOEXEC)
    try:
        for first, count in runs:
            try:
                os.posix_fallocate(fd, first * PAGE, count * PAGE)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    return 0
                raise
    finally:
        os.close(fd)
    return sum(count for _, count in runs) * PAGE


def copy_written(mapping: RamMapping, dest: Path) -> int:
    """Write the pages the (paused) process owns in ``mapping`` into ``dest`` at their offsets,
    through one small buffer (read from ``/proc/PID/mem``, written with ``pwrite``: no page
    faults on a mapping of ``dest``); returns the bytes written."""
    runs = _pagemap_runs(mapping)
    try:
        mem = os.open(f"/proc/{mapping.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PageForkUnavailable(f"cannot read QEMU's memory: {exc}") from exc
    buf = memoryview(bytearray(_CHUNK))
    written = 0
    try:
        out = os.open(dest, os.O_RDWR | os.O_CLOEXEC)
        try:
            for first, count in runs:
                off, end = first * PAGE, (first + count) * PAGE
                while off < end:
                    n = os.preadv(mem, [buf[: min(end - off, _CHUNK)]], mapping.start + off)
                    if n <= 0:
                        raise OSError(f"reading QEMU's memory stopped at offset {off}")
                    _write_all(out, buf[:n], off)
                    off, written = off + n, written + n
        finally:
            os.close(out)
    finally:
        os.close(mem)
    return written


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        n = os.pwrite(fd, data, offset)
        if n <= 0:
            raise OSError(f"writing the fork's RAM file stopped at offset {offset}")
        data, offset = data[n:], offset + n


def device_stream(devices: bytes, machine: str) -> bytes:
    """A migration stream of ``devices`` (``xen-save-devices-state``'s output: the header, then
    every device's section) with the configuration section ``migrate-incoming`` expects first
    (the machine type's name; no capabilities: load it with ``x-ignore-shared`` off)."""
    if devices[:8] != _MAGIC_VERSION:
        raise ValueError("not a device state saved by QEMU (stream version 3)")
    name = machine.encode()
    config = bytes([VM_CONFIGURATION]) + len(name).to_bytes(4, "big") + name
    return devices[:8] + config + devices[8:]
