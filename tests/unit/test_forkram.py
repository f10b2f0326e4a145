"""``hypervisor.forkram``: which pages a VM wrote (from a pagemap), the base file copied with
its holes, the written pages read from a process's memory (this test's own), room made for them first
without changing a byte, the device state
given its configuration section, and the RAM mapping found in /proc. The real thing (forks of
clones, of forks' children, of woken VMs) is in tests/vm/test_fast_start.py."""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import pytest

from hypervisor.forkram import (
    PageForkUnavailable,
    RamMapping,
    allocate_written,
    copy_base,
    copy_written,
    device_stream,
    find_ram,
    make_ram_file,
    written_runs,
)
from hypervisor.ramdiff import PAGE

pytestmark = pytest.mark.unit

PRESENT, SWAPPED, FILE = 1 << 63, 1 << 62, 1 << 61


def _pagemap(*entries: int) -> bytes:
    return struct.pack(f"<{len(entries)}Q", *entries)


def test_written_runs_are_the_present_or_swapped_pages_that_are_not_the_files() -> None:
    table = _pagemap(
        PRESENT | FILE | 7,  # read from the base file
        PRESENT | 9,  # written: the process's own page
        PRESENT | 10,
        0,  # never touched
        SWAPPED,  # written, then swapped out
        PRESENT | FILE,
        PRESENT | 11,
    )
    assert written_runs(table) == [(1, 2), (4, 1), (6, 1)]
    assert written_runs(b"") == []
    assert written_runs(_pagemap(PRESENT, PRESENT)) == [(0, 2)]


def test_copy_base_keeps_holes_and_copies_data(tmp_path: Path) -> None:
    base = tmp_path / "base"
    size = 64 * PAGE
    with base.open("wb") as f:
        f.truncate(size)
        f.seek(3 * PAGE)
        f.write(b"a" * PAGE)
        f.seek(40 * PAGE)
        f.write(b"b" * 2 * PAGE)
    dest = tmp_path / "dest"
    make_ram_file(dest, size)
    copied = copy_base(base, dest)
    assert dest.read_bytes() == base.read_bytes()
    # filesystems that report no holes copy everything; the ones that do copy only the data
    assert 3 * PAGE <= copied <= size
    with pytest.raises(FileExistsError):
        make_ram_file(dest, size)  # never an existing file
    with pytest.raises(PageForkUnavailable, match="cannot open"):
        copy_base(tmp_path / "missing", dest)


def test_copy_written_reads_the_written_pages_from_process_memory(tmp_path: Path) -> None:
    """This process maps a file privately and writes two pages: those two, and only those,
    land in the fork's file at their offsets."""
    size = 16 * PAGE
    base = tmp_path / "base"
    base.write_bytes(b"\x01" * size)
    with base.open("rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE) as ram:
        _ = ram[0 : PAGE * 16 : PAGE]  # read every page: present, but the file's
        ram[5 * PAGE : 6 * PAGE] = b"\x05" * PAGE
        ram[9 * PAGE : 9 * PAGE + 3] = b"abc"
        address = _address_of(ram)
        mapping = RamMapping(os.getpid(), address, address + size)
        dest = tmp_path / "fork"
        make_ram_file(dest, size)
        written = copy_written(mapping, dest)
    data = dest.read_bytes()
    assert written == 2 * PAGE
    assert data[5 * PAGE : 6 * PAGE] == b"\x05" * PAGE
    assert data[9 * PAGE : 9 * PAGE + 4] == b"abc\x01"
    assert data[: 5 * PAGE] == bytes(5 * PAGE)  # not written: left for the base's copy


def test_allocate_written_makes_room_for_the_written_pages_and_changes_no_data(tmp_path: Path) -> None:
    """Before the pause the fork's file gets pages where the process wrote (holes filled with
    zeros, data kept as it was); the paused copy then writes the same bytes as without it.
    Also across a run longer than the copy's buffer (1 MiB)."""
    size = 600 * PAGE
    base = tmp_path / "base"
    base.write_bytes(b"\x01" * size)
    with base.open("rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE) as ram:
        ram[2 * PAGE : 3 * PAGE] = b"\x02" * PAGE
        ram[300 * PAGE : 590 * PAGE] = b"\x03" * (290 * PAGE)  # 1.1 MiB, one run
        address = _address_of(ram)
        mapping = RamMapping(os.getpid(), address, address + size)
        dest = tmp_path / "fork"
        make_ram_file(dest, size)
        with dest.open("r+b") as out:
            out.seek(2 * PAGE)
            out.write(b"\x07" * PAGE)  # the base's copy was here before: it must stay
        allocated = allocate_written(mapping, dest)
        data = dest.read_bytes()
        assert data[2 * PAGE : 3 * PAGE] == b"\x07" * PAGE
        assert data[300 * PAGE : 590 * PAGE] == bytes(290 * PAGE)
        if allocated:  # a filesystem that cannot allocate ahead says 0
            assert allocated == 291 * PAGE
            assert os.stat(dest).st_blocks * 512 >= 291 * PAGE
        written = copy_written(mapping, dest)
    data = dest.read_bytes()
    assert written == 291 * PAGE
    assert data[2 * PAGE : 3 * PAGE] == b"\x02" * PAGE
    assert data[300 * PAGE : 590 * PAGE] == b"\x03" * (290 * PAGE)
    assert data[590 * PAGE :] == bytes(10 * PAGE)


def _address_of(ram: mmap.mmap) -> int:
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(ram))


def test_device_stream_puts_the_configuration_section_after_the_header() -> None:
    devices = bytes.fromhex("5145564d00000003") + b"\x04device-sections\x00"
    out = device_stream(devices, "pc-i440fx-7.2")
    assert out == bytes.fromhex("5145564d00000003") + b"\x07\x00\x00\x00\x0dpc-i440fx-7.2" + devices[8:]
    with pytest.raises(ValueError, match="stream version 3"):
        device_stream(b"QEVM\x00\x00\x00\x02", "pc")


def test_find_ram_takes_the_one_private_file_mapping_of_the_ram_size(tmp_path: Path) -> None:
    size = 512 << 20
    lo = 0x7F0000000000
    maps = tmp_path / "42" / "maps"
    maps.parent.mkdir()
    maps.write_text(
        f"{lo - size:x}-{lo:x} rw-p 00000000 00:00 0 \n"  # anonymous: libvirt's unused RAM
        f"{lo:x}-{lo + size:x} rw-p 00000000 00:1a 7 /dev/shm/kh/templates/python-x/ram\n"
        f"{lo + size:x}-{lo + size + 4096:x} r--p 00000000 00:1a 8 /usr/lib/libc.so\n"
    )
    found = find_ram(42, size, proc=tmp_path)
    assert (found.pid, found.start, found.size) == (42, lo, size)
    assert found.path == "/dev/shm/kh/templates/python-x/ram"
    assert found.map_file == f"/proc/42/map_files/{lo:x}-{lo + size:x}"

    maps.write_text(f"{lo:x}-{lo + size:x} rw-p 00000000 00:1a 7 /dev/shm/kh/forks/x/ram (deleted)\n")
    assert find_ram(42, size, proc=tmp_path).path is None  # a fork's file, removed

    maps.write_text(f"{lo:x}-{lo + size:x} rw-s 00000000 00:1a 7 /dev/shm/kh/anon/qemu_back_mem (deleted)\n")
    with pytest.raises(PageForkUnavailable, match="shared"):
        find_ram(42, size, proc=tmp_path)
    with pytest.raises(PageForkUnavailable, match="not one"):
        find_ram(42, size * 2, proc=tmp_path)
    with pytest.raises(PageForkUnavailable, match="cannot read"):
        find_ram(43, size, proc=tmp_path)
