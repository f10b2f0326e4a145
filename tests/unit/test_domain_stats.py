"""hypervisor/stats.py: a domain's CPU time and resident memory from /proc of its QEMU (a reused
pid is not taken for it), else from libvirt (here its test driver; tests/vm/test_usage_metrics.py
reads real VMs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import libvirt
import pytest

from hypervisor import stats

pytestmark = pytest.mark.unit


def test_proc_names_the_domain_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stats, "PID_DIR", tmp_path)
    code = "import time\nx = bytearray(32 << 20)\nfor i in range(0, len(x), 4096): x[i] = 1\ntime.sleep(60)"
    fake = subprocess.Popen([sys.executable, "-c", code, "-name", "guest=khfake-1,debug-threads=on"])
    try:
        (tmp_path / "khfake-1.pid").write_text(f"{fake.pid}\n")
        (tmp_path / "khfake-2.pid").write_text(f"{fake.pid}\n")  # a pid that is not this domain's
        for _ in range(100):
            st = stats.proc_stats("khfake-1")
            if st is not None and st.rss_bytes > 32 << 20:
                break
            subprocess.run(["sleep", "0.05"], check=True)
        assert st is not None and st.rss_bytes > 32 << 20 and st.cpu_ns >= 0, st
        assert stats.proc_stats("khfake-2") is None
        assert stats.proc_stats("khfake-3") is None  # no pid file: not running
        assert stats.proc_stats("../khfake-1") is None

        def no_libvirt() -> libvirt.virConnect:
            raise AssertionError("libvirt asked although /proc answered")

        assert set(stats.domain_stats(["khfake-1"], no_libvirt)) == {"khfake-1"}
    finally:
        fake.kill()
        fake.wait()


def test_libvirt_answers_for_the_rest() -> None:
    """The test driver's running ``test`` domain has no CPU stats (a real one has): it is left
    out like a domain that stopped meanwhile; a missing name is no error."""
    conn = libvirt.open("test:///default")
    try:
        assert stats.domain_stats(["test", "no-such-domain"], lambda: conn) == {}
    finally:
        conn.close()
