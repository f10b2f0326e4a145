"""Issue 35, finding 15, without a VM: domains carry a static DAC label libvirt does not relabel
files for, and the files every VM starts from are made root's and read-only to QEMU. The VM tier
checks the same on real files after real starts (tests/vm/test_image_ownership.py)."""

from __future__ import annotations

import os
from pathlib import Path
from xml.etree import ElementTree

import libvirt
import pytest

from hypervisor import DomainSpec
from hypervisor.ownership import dac_label, keep_from_qemu, keep_images_from_qemu

pytestmark = pytest.mark.unit


def _spec(label: str) -> DomainSpec:
    return DomainSpec(
        name="kh-x",
        uuid="00000000-0000-0000-0000-000000000001",
        kernel=Path("/img/vmlinuz"),
        initrd=Path("/img/initrd.img"),
        rootfs=Path("/img/rootfs.erofs"),
        layers=(Path("/img/layer.erofs"),),
        channel_socket=Path("/run/x/agent.sock"),
        console_log=Path("/run/x/console.log"),
        dac_label=label,
    )


def test_a_domain_with_libvirts_label_is_not_relabelled() -> None:
    root = ElementTree.fromstring(_spec("+64055:+64055").to_xml())
    labels = root.findall("seclabel")
    assert len(labels) == 1
    assert labels[0].attrib == {"type": "static", "model": "dac", "relabel": "no"}
    assert labels[0].findtext("label") == "+64055:+64055"
    assert ElementTree.fromstring(_spec("").to_xml()).find("seclabel") is None


class _Caps:
    def __init__(self, xml: str) -> None:
        self.xml = xml

    def getCapabilities(self) -> str:
        return self.xml


def test_dac_label_comes_from_libvirts_capabilities() -> None:
    caps = """<capabilities><host>
      <secmodel><model>apparmor</model><doi>0</doi></secmodel>
      <secmodel><model>dac</model><doi>0</doi>
        <baselabel type='kvm'>+64055:+107</baselabel><baselabel type='qemu'>+64055:+64055</baselabel>
      </secmodel></host></capabilities>"""
    assert dac_label(_Caps(caps)) == "+64055:+64055"
    assert dac_label(_Caps("<capabilities><host/></capabilities>")) == ""
    assert dac_label(libvirt.open("test:///default")) == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to root needs root")
def test_keep_from_qemu_makes_files_roots_and_read_only(tmp_path: Path) -> None:
    image = tmp_path / "rootfs.erofs"
    image.write_bytes(b"x")
    os.chown(image, 64055, 64055)
    image.chmod(0o666)
    keep_images_from_qemu(image, tmp_path / "absent.erofs")
    st = image.stat()
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (0, 0, 0o644)
    keep_from_qemu(tmp_path, 0o755)
    assert tmp_path.stat().st_mode & 0o7777 == 0o755
