"""A sandbox's usage reading (kernelhost/sandboxes/inside/usage.py): what the guest's probe prints,
parsed."""

from __future__ import annotations

import subprocess

import pytest

from kernelhost.sandboxes.inside.usage import PROBE, parse_probe

pytestmark = pytest.mark.unit

SAMPLE = """MemTotal:         502148 kB
MemFree:          301020 kB
MemAvailable:     402148 kB
Buffers:            1024 kB
Cached:            50176 kB
--
tmpfs              268435456  1048576 267386880       1% /home/user
"""


def test_the_probe_is_read_in_bytes() -> None:
    total, used, cache, disk_total, disk_used = parse_probe(SAMPLE)
    assert (total, used, cache) == (502148 * 1024, 100000 * 1024, 51200 * 1024)
    assert (disk_total, disk_used) == (268435456, 1048576)


def test_the_probe_of_this_machine_parses() -> None:
    out = subprocess.run(
        ["bash", "-c", PROBE.replace("/home/user", "/")], capture_output=True, text=True, check=True
    ).stdout
    total, used, _, disk_total, disk_used = parse_probe(out)
    assert 0 < used < total and 0 < disk_used <= disk_total


def test_a_broken_probe_is_an_error() -> None:
    with pytest.raises((ValueError, KeyError, IndexError)):
        parse_probe("MemTotal: 1 kB\n")
