"""A VM's saved state, less the RAM pages a base RAM file already holds.

A full save (``save_state(..., ignore_shared=False)``) is a QEMU migration stream: a header, the
``ram`` section's page records (RAM_SAVE_FLAG_PAGE with 4 KiB of data, RAM_SAVE_FLAG_ZERO with a
fill byte), then every device's state. ``diff_stream`` copies such a stream, dropping each page
record of the main RAM block whose content equals the base's page at that offset (and each zero
page of a zero base page). What is left is still a valid stream: loaded into a VM whose RAM maps
the base file privately (``load_state(..., ignore_shared=False)``), it gives back the saved VM
exactly, because every page it no longer carries is already there. Its size grows with what the
VM changed since the base, not with the VM's RAM.

This reads the stream format of QEMU's precopy migration without compression, XBZRLE, multifd
or RDMA (none is enabled here); anything else is refused with ``StreamNotUnderstood`` rather
than guessed at. Sans-IO apart from the buffers it is handed: no libvirt, no Jupyter.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias

Buffer: TypeAlias = bytes | bytearray | memoryview | mmap.mmap
Chunk: TypeAlias = bytes | bytearray | memoryview

PAGE = 4096
MAGIC = 0x5145564D  # "QEVM"
VERSION = 3

# section kinds (migration/savevm.c)
VM_EOF, SECTION_START, SECTION_PART, SECTION_END, SECTION_FULL = 0x00, 0x01, 0x02, 0x03, 0x04
VM_CONFIGURATION, SECTION_FOOTER = 0x07, 0x7E
# RAM record flags (migration/ram.c)
F_ZERO, F_MEM_SIZE, F_PAGE, F_EOS, F_CONTINUE = 0x02, 0x04, 0x08, 0x10, 0x20
FLAG_MASK = PAGE - 1


class StreamNotUnderstood(ValueError):
    """The saved state is not laid out as this reader knows; nothing was written for it."""

    def __init__(self, offset: int, detail: str) -> None:
        super().__init__(f"the VM's saved state is not understood at byte {offset}: {detail}")
        self.offset = offset


@dataclass
class DiffStats:
    pages: int = 0  # page records in the stream
    kept: int = 0  # page records written (they differ from the base)
    bytes_in: int = 0
    bytes_out: int = 0


class _Reader:
    def __init__(self, data: Buffer) -> None:
        self.m = memoryview(data).cast("B")
        self.raw: Buffer = data.tobytes() if isinstance(data, memoryview) else data  # slices are bytes
        self.p = 0

    def take(self, n: int) -> memoryview:
        if self.p + n > len(self.m):
            raise StreamNotUnderstood(self.p, f"the stream ends {self.p + n - len(self.m)} bytes early")
        v = self.m[self.p : self.p + n]
        self.p += n
        return v

    def u8(self) -> int:
        return self.take(1)[0]

    def be32(self) -> int:
        return int.from_bytes(self.take(4), "big")

    def be64(self) -> int:
        return int.from_bytes(self.take(8), "big")

    def name(self) -> bytes:
        return bytes(self.take(self.u8()))


def diff_stream(
    data: Buffer, write: Callable[[Chunk], object], *, main_block: str, base: Buffer | None
) -> DiffStats:
    """Write ``data`` (a whole saved state) less the pages of block ``main_block`` that equal
    ``base`` (None: a zero-filled RAM) through ``write``."""
    r = _Reader(data)
    stats = DiffStats(bytes_in=len(r.m))
    out = _Out(write, stats)
    base_view = memoryview(base).cast("B") if base is not None else None
    if isinstance(base, memoryview):
        base = base.tobytes()
    ram = _RamSection(r, out, main_block.encode(), base_view, base, stats)
    start = r.p
    if r.be32() != MAGIC or r.be32() != VERSION:
        raise StreamNotUnderstood(start, "not a QEMU migration stream of version 3")
    if r.m[r.p] == VM_CONFIGURATION:
        r.p += 1
        r.take(r.be32())  # the machine type's name
    out.raw(r.m[start : r.p])
    while True:
        at = r.p
        kind = r.u8()
        if kind == SECTION_START:
            ram.start(at)
        elif kind in (SECTION_PART, SECTION_END) and ram.sid is not None:
            ram.part(at, kind)
        elif kind in (SECTION_FULL, VM_EOF) and ram.sid is not None:
            # the devices' state, copied as it is: after the RAM section's end, or (a
            # background snapshot, which never ends it) after its last part
            out.raw(r.m[at:])
            break
        else:
            raise StreamNotUnderstood(at, f"unexpected section kind {kind:#x}")
    out.flush()
    return stats


class _Out:
    """Batches small writes (the headers of kept records) between the large ones."""

    def __init__(self, write: Callable[[Chunk], object], stats: DiffStats) -> None:
        self.write = write
        self.stats = stats
        self.buf = bytearray()

    def raw(self, data: Chunk) -> None:
        view = memoryview(data)
        self.stats.bytes_out += view.nbytes
        if view.nbytes >= 1 << 16:
            self.flush()
            self.write(view)
        else:
            self.buf += view
            if len(self.buf) >= 1 << 20:
                self.flush()

    def flush(self) -> None:
        if self.buf:
            self.write(self.buf)
            self.buf = bytearray()


class _RamSection:
    def __init__(
        self,
        r: _Reader,
        out: _Out,
        main: bytes,
        base: memoryview | None,
        base_raw: Buffer | None,
        stats: DiffStats,
    ) -> None:
        self.r, self.out, self.main, self.base, self.stats = r, out, main, base, stats
        self.base_raw = base_raw
        self.raw = r.raw
        self.sid: int | None = None
        self.block = b""  # the block of the last record read
        self.sent = b""  # the block of the last record written
        # main-block pages seen: a page sent twice (a precopy of a running VM) would make the
        # last version, not the first, the one that counts; this reader refuses such streams
        self.seen = bytearray(base.nbytes // PAGE if base is not None else 0)

    def start(self, at: int) -> None:
        r = self.r
        sid, idstr = r.be32(), r.name()
        r.be32(), r.be32()  # instance and version
        if idstr != b"ram" or self.sid is not None:
            raise StreamNotUnderstood(at, f"a live section {idstr!r} this reader does not know")
        self.sid = sid
        total = r.be64()
        if total & FLAG_MASK != F_MEM_SIZE:
            raise StreamNotUnderstood(at, "the RAM section does not start with the block list")
        left = total & ~FLAG_MASK
        while left > 0:
            name, length = r.name(), r.be64()
            if name == self.main and self.base is not None and length != self.base.nbytes:
                raise StreamNotUnderstood(
                    r.p, f"block {name!r} holds {length} bytes; the base RAM file {self.base.nbytes}"
                )
            left -= length
        if r.be64() != F_EOS:
            raise StreamNotUnderstood(r.p, "the block list is not followed by its end")
        self._footer()
        self.out.raw(r.m[at : r.p])

    def part(self, at: int, kind: int) -> None:
        r = self.r
        if r.be32() != self.sid:
            raise StreamNotUnderstood(at, "a section of a device this reader does not know")
        self.out.raw(r.m[at : r.p])
        self._records()
        self.out.raw(r.m[r.p - 8 : r.p])  # the EOS
        foot = r.p
        self._footer()
        self.out.raw(r.m[foot : r.p])

    def _records(self) -> None:
        """The page records up to the section's EOS: one tight loop (a VM's state holds one
        record per page, 131072 for 512 MiB), reading the raw buffers, whose slices are bytes
        that compare with memcmp (memoryviews compare item by item, ten times slower)."""
        r, raw, base, main, seen = self.r, self.raw, self.base_raw, self.main, self.seen
        view, end, p, block = r.m, len(raw), r.p, self.block
        pages = 0
        try:
            while True:
                at = p
                (head,) = _BE64(raw, p)
                p += 8
                flags = head & FLAG_MASK
                if flags == F_EOS:
                    break
                if not flags & F_CONTINUE:
                    n = raw[p]
                    block = bytes(raw[p + 1 : p + 1 + n])
                    p += 1 + n
                addr = head & ~FLAG_MASK
                kind = flags & ~F_CONTINUE
                if kind == F_ZERO:
                    fill = raw[p]
                    p += 1
                    keep = block != main or (
                        fill != 0 if base is None else fill != 0 or base[addr : addr + PAGE] != _ZERO
                    )
                elif kind == F_PAGE:
                    p += PAGE
                    if p > end:
                        raise StreamNotUnderstood(at, "the stream ends inside a page")
                    keep = block != main or base is None or raw[p - PAGE : p] != base[addr : addr + PAGE]
                else:
                    raise StreamNotUnderstood(at, f"RAM record flags {flags:#x} (compressed or XBZRLE pages)")
                pages += 1
                if seen and block == main:
                    index = addr // PAGE
                    if seen[index]:
                        raise StreamNotUnderstood(at, f"page {index} of {main.decode()!r} is sent twice")
                    seen[index] = 1
                if keep:
                    self.block = block
                    self._emit(head, view[p - (1 if kind == F_ZERO else PAGE) : p])
        except (struct.error, IndexError):
            raise StreamNotUnderstood(p, "the stream ends early") from None
        finally:
            self.stats.pages += pages
        self.block = block
        r.p = p

    def _emit(self, head: int, payload: memoryview) -> None:
        self.stats.kept += 1
        if self.block == self.sent:
            self.out.raw((head | F_CONTINUE).to_bytes(8, "big"))
        else:
            self.out.raw((head & ~F_CONTINUE).to_bytes(8, "big") + bytes([len(self.block)]) + self.block)
            self.sent = self.block
        self.out.raw(payload)

    def _footer(self) -> None:
        r = self.r
        if r.p < len(r.m) and r.m[r.p] == SECTION_FOOTER:
            r.p += 1
            if r.be32() != self.sid:
                raise StreamNotUnderstood(r.p - 4, "a section footer of another section")


_ZERO = bytes(PAGE)
_BE64 = struct.Struct(">Q").unpack_from
