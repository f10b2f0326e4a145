"""``hypervisor.ramdiff``: a saved VM state less the pages its base RAM holds, on synthetic
QEMU migration streams laid out as QEMU 7.2 writes them. The real thing (a VM's state diffed,
stored, loaded into a new VM) is in tests/vm/test_checkpoints.py."""

from __future__ import annotations

import os
import struct

import pytest

from hypervisor.ramdiff import (
    F_CONTINUE,
    F_EOS,
    F_MEM_SIZE,
    F_PAGE,
    F_ZERO,
    PAGE,
    StreamNotUnderstood,
    diff_stream,
)

pytestmark = pytest.mark.unit

SID = 3
PAGES = 6


def _name(s: bytes) -> bytes:
    return bytes([len(s)]) + s


def _record(block: bytes, index: int, flag: int, payload: bytes, last: list[bytes]) -> bytes:
    head = index * PAGE | flag
    if last and last[0] == block:
        return struct.pack(">Q", head | F_CONTINUE) + payload
    last[:] = [block]
    return struct.pack(">Q", head) + _name(block) + payload


def stream(ram: bytes, bios: bytes, *, devices: bytes = b"\x04devstate\x00", live: bool = False) -> bytes:
    """A whole save: every page of ``ram`` (block khram) and ``bios`` as QEMU writes them;
    ``live``: as a background snapshot does (its RAM section has parts and no end)."""
    out = struct.pack(">II", 0x5145564D, 3) + b"\x07" + struct.pack(">I", 13) + b"pc-i440fx-7.2"
    out += b"\x01" + struct.pack(">I", SID) + _name(b"ram") + struct.pack(">II", 0, 4)
    out += struct.pack(">Q", (len(ram) + len(bios)) | F_MEM_SIZE)
    out += _name(b"khram") + struct.pack(">Q", len(ram)) + _name(b"pc.bios") + struct.pack(">Q", len(bios))
    out += struct.pack(">Q", F_EOS) + b"\x7e" + struct.pack(">I", SID)
    last: list[bytes] = []
    for kind, block, data in ((0x02, b"khram", ram), (0x02 if live else 0x03, b"pc.bios", bios)):
        out += bytes([kind]) + struct.pack(">I", SID)
        for i in range(len(data) // PAGE):
            page = data[i * PAGE : (i + 1) * PAGE]
            if page == bytes(PAGE):
                out += _record(block, i, F_ZERO, b"\x00", last)
            else:
                out += _record(block, i, F_PAGE, page, last)
        out += struct.pack(">Q", F_EOS) + b"\x7e" + struct.pack(">I", SID)
    return out + devices


def load(saved: bytes, ram: bytearray) -> tuple[bytearray, bytes]:
    """What QEMU's incoming side does with ``saved`` over ``ram`` (the base, mapped privately):
    the RAM after the load, and the device state that followed the RAM section."""
    p = 8 + 1 + 4 + 13
    assert saved[p] == 0x01
    p += 1 + 4 + 4 + 4 + 4  # kind, sid, "ram", instance, version
    total = struct.unpack(">Q", saved[p : p + 8])[0] & ~(PAGE - 1)
    p += 8
    while total:
        n = saved[p]
        p += 1 + n
        total -= struct.unpack(">Q", saved[p : p + 8])[0]
        p += 8
    p += 8 + 5  # EOS, footer
    block = b""
    for _ in range(2):
        p += 5
        while True:
            head = struct.unpack(">Q", saved[p : p + 8])[0]
            p += 8
            if head & (PAGE - 1) == F_EOS:
                break
            if not head & F_CONTINUE:
                block = saved[p + 1 : p + 1 + saved[p]]
                p += 1 + saved[p]
            addr = head & ~(PAGE - 1)
            if head & F_ZERO:
                page = bytes([saved[p]]) * PAGE
                p += 1
            else:
                page = saved[p : p + PAGE]
                p += PAGE
            if block == b"khram":
                ram[addr : addr + PAGE] = page
        p += 5
    return ram, saved[p:]


def _pages(*pages: bytes) -> bytes:
    return b"".join(pages)


def test_only_the_pages_that_differ_from_the_base_are_kept_and_the_load_gives_the_vm_back() -> None:
    a, b, c = (os.urandom(PAGE) for _ in range(3))
    zero = bytes(PAGE)
    base = _pages(a, b, c, zero, a, zero)
    now = _pages(a, c, zero, zero, a, b)  # page 1 changed, page 2 zeroed, page 5 written
    bios = os.urandom(PAGE)
    full = stream(now, bios)
    out = bytearray()
    stats = diff_stream(full, out.extend, main_block="khram", base=base)
    assert stats.pages == PAGES + 1
    assert stats.kept == 4  # pages 1, 2, 5 and the bios page (other blocks are kept whole)
    assert stats.bytes_out == len(out) < len(full)
    ram, devices = load(bytes(out), bytearray(base))
    assert bytes(ram) == now
    assert devices == b"\x04devstate\x00"


def test_without_a_base_zero_pages_are_dropped_and_the_rest_kept() -> None:
    a = os.urandom(PAGE)
    now = _pages(a, bytes(PAGE), bytes(PAGE), a, bytes(PAGE), bytes(PAGE))
    out = bytearray()
    stats = diff_stream(stream(now, bytes(PAGE)), out.extend, main_block="khram", base=None)
    assert stats.kept == 3  # two data pages, and the (zero) bios page of another block
    ram, _ = load(bytes(out), bytearray(PAGES * PAGE))
    assert bytes(ram) == now


def test_a_stream_of_another_shape_or_format_is_refused_not_guessed() -> None:
    now = os.urandom(PAGES * PAGE)
    with pytest.raises(StreamNotUnderstood, match="base RAM file"):
        diff_stream(stream(now, bytes(PAGE)), bytearray().extend, main_block="khram", base=bytes(PAGE))
    with pytest.raises(StreamNotUnderstood, match="not a QEMU migration stream"):
        diff_stream(b"\x00" * 64, bytearray().extend, main_block="khram", base=None)
    truncated = stream(now, bytes(PAGE))[:5000]
    with pytest.raises(StreamNotUnderstood, match="ends"):
        diff_stream(truncated, bytearray().extend, main_block="khram", base=None)
    compressed = bytearray(stream(now, bytes(PAGE)))
    first = compressed.index(b"\x05khram", 60) - 8  # the first page record's header
    compressed[first + 6 : first + 8] = struct.pack(">H", 0x100 | F_PAGE)  # a compressed page
    with pytest.raises(StreamNotUnderstood, match="flags"):
        diff_stream(bytes(compressed), bytearray().extend, main_block="khram", base=None)


def test_a_background_snapshot_whose_ram_section_never_ends_is_read() -> None:
    a = os.urandom(PAGE)
    base = bytes(PAGES * PAGE)
    now = _pages(a, bytes(PAGE), a, bytes(PAGE), bytes(PAGE), a)
    out = bytearray()
    stats = diff_stream(stream(now, bytes(PAGE), live=True), out.extend, main_block="khram", base=base)
    assert stats.kept == 4
    ram, devices = load(bytes(out), bytearray(base))
    assert bytes(ram) == now and devices == b"\x04devstate\x00"


def test_a_page_sent_twice_is_refused() -> None:
    now = os.urandom(PAGES * PAGE)
    full = bytearray(stream(now, bytes(PAGE)))
    second = full.index(b"\x02" + struct.pack(">I", SID), 60)  # the first part section
    again = struct.pack(">Q", 0 | F_PAGE) + _name(b"khram") + now[:PAGE]
    full[second + 5 : second + 5] = again  # page 0 once more, first in the section
    with pytest.raises(StreamNotUnderstood, match="sent twice"):
        diff_stream(bytes(full), bytearray().extend, main_block="khram", base=bytes(PAGES * PAGE))
