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

import mmap
import os
from array import array
from dataclasses import dataclass
from pathlib import Path

from .errors import HypervisorError
from .ramdiff import MAGIC, PAGE, VERSION, VM_CONFIGURATION

_PRESENT = 1 << 63
_SWAPPED = 1 << 62
_FILE = 1 << 61
_MAGIC_VERSION = MAGIC.to_bytes(4, "big") + VERSION.to_bytes(4, "big")
_READ_RUN = 64 << 20  # bytes read from /proc/PID/mem at a time


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
    present or swapped, and not the file's page. ``pagemap``: 8 bytes a page."""
    entries = array("Q")
    entries.frombytes(pagemap)
    runs: list[tuple[int, int]] = []
    start = -1
    for i, e in enumerate(entries):
        own = bool(e & (_PRESENT | _SWAPPED)) and not e & _FILE
        if own and start < 0:
            start = i
        elif not own and start >= 0:
            runs.append((start, i - start))
            start = -1
    if start >= 0:
        runs.append((start, len(entries) - start))
    return runs


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


def copy_written(mapping: RamMapping, dest: Path) -> int:
    """Write the pages the (paused) process owns in ``mapping`` into ``dest`` at their offsets;
    returns the bytes written."""
    pages = mapping.size // PAGE
    try:
        with open(f"/proc/{mapping.pid}/pagemap", "rb", buffering=0) as f:
            table = os.pread(f.fileno(), pages * 8, mapping.start // PAGE * 8)
        mem = os.open(f"/proc/{mapping.pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PageForkUnavailable(f"cannot read QEMU's memory: {exc}") from exc
    if len(table) != pages * 8:
        os.close(mem)
        raise PageForkUnavailable("QEMU's page table ended early")
    written = 0
    try:
        with open(dest, "r+b") as out, mmap.mmap(out.fileno(), mapping.size) as ram:
            view = memoryview(ram)
            try:
                for first, count in written_runs(table):
                    off, left = first * PAGE, count * PAGE
                    while left:
                        n = os.preadv(mem, [view[off : off + min(left, _READ_RUN)]], mapping.start + off)
                        if n <= 0:
                            raise OSError(f"reading QEMU's memory stopped at offset {off}")
                        off, left, written = off + n, left - n, written + n
            finally:
                view.release()
    finally:
        os.close(mem)
    return written


def device_stream(devices: bytes, machine: str) -> bytes:
    """A migration stream of ``devices`` (``xen-save-devices-state``'s output: the header, then
    every device's section) with the configuration section ``migrate-incoming`` expects first
    (the machine type's name; no capabilities: load it with ``x-ignore-shared`` off)."""
    if devices[:8] != _MAGIC_VERSION:
        raise ValueError("not a device state saved by QEMU (stream version 3)")
    name = machine.encode()
    config = bytes([VM_CONFIGURATION]) + len(name).to_bytes(4, "big") + name
    return devices[:8] + config + devices[8:]
