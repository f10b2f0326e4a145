"""A failed test in the VM tiers keeps the evidence of its services (tests/harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..harness import LIVE, Service

pytestmark = pytest.mark.unit


def test_evidence_holds_the_service_log_and_each_vms_xml_and_console(tmp_path: Path) -> None:
    # libvirt's test driver runs one domain, "test": a service whose prefix is "test" owns it
    svc = Service.make(
        tmp_path, KERNELHOST_LIBVIRT_URI="test:///default", KERNELHOST_RUN_DIR=str(tmp_path / "run")
    )
    svc.prefix = "test"
    (tmp_path / "run" / "test").mkdir(parents=True)
    (tmp_path / "run" / "test" / "console.log").write_text("kernelhost-init: booted\n")
    svc.log_path.write_text('{"event": "service.ready"}\n')
    svc.save_evidence(tmp_path / "evidence")
    saved = {p.name for p in (tmp_path / "evidence").iterdir()}
    assert saved == {"service.log", "test.xml", "test.console.log"}, saved
    assert "<domain" in (tmp_path / "evidence" / "test.xml").read_text()
    assert "booted" in (tmp_path / "evidence" / "test.console.log").read_text()
    assert svc not in LIVE  # never started: nothing to tear down


def test_evidence_of_an_unreachable_libvirt_is_a_note_not_an_error(tmp_path: Path) -> None:
    svc = Service.make(tmp_path, KERNELHOST_LIBVIRT_URI="qemu+unix:///system?socket=/nonexistent")
    svc.log_path.write_text("log\n")
    svc.save_evidence(tmp_path / "evidence")
    assert (tmp_path / "evidence" / "service.log").read_text() == "log\n"
    assert "libvirt" in (tmp_path / "evidence" / "evidence-error.txt").read_text()
