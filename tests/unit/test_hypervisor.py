"""The hypervisor layer on libvirt's in-memory test driver (no QEMU)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import libvirt
import pytest

from hypervisor import DomainSpec, GuestImage, Hypervisor, ImageNotFound, ImageStore
from hypervisor.accel import choose_accel

pytestmark = pytest.mark.unit


@pytest.fixture
def image(tmp_path: Path) -> GuestImage:
    d = tmp_path / "images" / "python-abc"
    d.mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.erofs"):
        (d / name).write_bytes(b"x")
    (d / "manifest.json").write_text(json.dumps({"template": "python", "key": "abc"}))
    (tmp_path / "images" / "python").symlink_to("python-abc")
    return ImageStore(tmp_path / "images").get("python")


@pytest.fixture
def hv(tmp_path: Path) -> Iterator[Hypervisor]:
    # each test gets its own private in-memory driver instance
    h = Hypervisor("test:///default", "khtest-", tmp_path / "run")
    yield h
    for info in h.domains():
        h.destroy(info.name)
    h.close()


def test_image_store_lists_and_rejects(image: GuestImage, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    assert store.templates() == ["python"]
    assert image.key == "abc" and image.kernel.name == "vmlinuz"
    with pytest.raises(ImageNotFound) as err:
        store.get("nope")
    assert "'nope'" in str(err.value) and "python" in str(err.value) and "make image" in str(err.value)
    with pytest.raises(ImageNotFound):
        store.get("../python")


def _spec(image: GuestImage, tmp_path: Path, **fields: Any) -> DomainSpec:
    return DomainSpec(
        name="kh-a",
        uuid=str(uuid.uuid4()),
        kernel=image.kernel,
        initrd=image.initrd,
        rootfs=image.rootfs,
        channel_socket=tmp_path / "a.sock",
        console_log=tmp_path / "c.log",
        **fields,
    )


def test_domain_xml_shape(image: GuestImage, tmp_path: Path) -> None:
    spec = _spec(image, tmp_path, metadata={"sandbox": "sbx_1"})
    xml = spec.to_xml()
    assert "<domain type='qemu'" in xml
    assert "org.kernelhost.0" in xml and "<readonly/>" in xml and "<interface" not in xml
    assert "<controller type='usb' model='none'/>" in xml  # no USB bus for a guest to poke
    assert 'sandbox="sbx_1"' in xml
    assert "kh.upper_size=50%" in spec.cmdline
    kvm = DomainSpec(**{**spec.__dict__, "accel": "kvm"})
    assert "<domain type='kvm'" in kvm.to_xml() and "host-passthrough" in kvm.to_xml()
    assert "<cputune>" not in xml  # no cap unless asked
    capped = DomainSpec(**{**spec.__dict__, "cpu_quota_percent": 25}).to_xml()
    assert "<cputune><period>100000</period><quota>25000</quota></cputune>" in capped


def test_only_a_booted_vm_is_given_the_kernel(image: GuestImage, tmp_path: Path) -> None:
    booted = _spec(image, tmp_path, mem_path=tmp_path / "ram")
    xml = booted.to_xml()
    assert f"<kernel>{image.kernel}</kernel>" in xml and f"<initrd>{image.initrd}</initrd>" in xml
    assert "<cmdline>console=ttyS0 " in xml
    # a VM that loads a saved state runs the kernel in that state's RAM: QEMU is not made to
    # hold a copy of the kernel image for a boot that never comes
    loaded = DomainSpec(**{**booted.__dict__, "incoming": True}).to_xml()
    assert "<kernel>" not in loaded and "<initrd>" not in loaded and "<cmdline>" not in loaded
    assert 'value="-incoming"' in loaded and "memory-backend-file" in loaded


@pytest.mark.parametrize(
    "bad", [{"accel": "xen"}, {"memory_mib": 64}, {"vcpus": 0}, {"cpu_quota_percent": 150}]
)
def test_domain_spec_rejects_bad_values(bad: dict[str, Any], tmp_path: Path) -> None:
    base = dict(
        name="kh-a",
        uuid="u",
        kernel=Path("/k"),
        initrd=Path("/i"),
        rootfs=Path("/r"),
        channel_socket=tmp_path / "a.sock",
        console_log=tmp_path / "c.log",
    )
    with pytest.raises(ValueError) as err:
        DomainSpec(**{**base, **bad})
    assert str(next(iter(bad.values()))) in str(err.value)


def test_start_list_destroy_is_idempotent(hv: Hypervisor, image: GuestImage) -> None:
    name = hv.new_name()
    spec = hv.spec_for(name, image, accel="tcg", memory_mib=256, vcpus=1, metadata={"sandbox": "sbx_x"})
    hv.start(spec)
    assert hv.is_running(name)
    [info] = [d for d in hv.domains() if d.name == name]
    assert info.metadata == {"sandbox": "sbx_x"}
    assert hv.vm_dir(name).is_dir()
    assert hv.destroy(name) is True
    assert not hv.is_running(name)
    assert not hv.vm_dir(name).exists()
    assert hv.destroy(name) is False  # second destroy: nothing left, no error


def test_reconcile_destroys_unknown_domains_and_stray_dirs(hv: Hypervisor, image: GuestImage) -> None:
    keep, drop = hv.new_name(), hv.new_name()
    for name in (keep, drop):
        hv.start(hv.spec_for(name, image, accel="tcg", memory_mib=256, vcpus=1))
    stray = hv.vm_dir(hv.new_name())
    stray.mkdir(parents=True)
    (stray / "console.log").write_text("old")
    foreign = hv.conn.createXML(
        "<domain type='test'><name>someone-else</name><memory>65536</memory>"
        "<os><type>hvm</type></os></domain>",
        0,
    )
    removed = hv.reconcile({keep})
    assert drop in removed and stray.name in removed and keep not in removed
    assert hv.is_running(keep) and not hv.is_running(drop) and not stray.exists()
    assert foreign.isActive()  # other prefixes are never touched
    foreign.destroy()


def test_names_outside_the_prefix_are_refused(hv: Hypervisor) -> None:
    with pytest.raises(ValueError, match="prefix"):
        hv.destroy("other-vm")
    with pytest.raises(ValueError, match="prefix"):
        hv.cleanup_files("khtest-../../etc")


def test_accel_tcg_when_configured(hv: Hypervisor, image: GuestImage, tmp_path: Path) -> None:
    assert choose_accel(hv, image, "tcg", tmp_path / "accel.json") == ("tcg", "configured")
    with pytest.raises(ValueError, match="auto, kvm, tcg"):
        choose_accel(hv, image, "fast", tmp_path / "accel.json")


def test_accel_probe_result_is_cached(
    hv: Hypervisor, image: GuestImage, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def fake_probe(h, img, timeout):
        calls.append(1)
        return False, "probe guest hung"

    monkeypatch.setattr("hypervisor.accel.probe_kvm", fake_probe)
    cache = tmp_path / "accel.json"
    assert choose_accel(hv, image, "auto", cache) == ("tcg", "probe guest hung")
    accel, reason = choose_accel(hv, image, "auto", cache)
    assert accel == "tcg" and reason.startswith("cached probe") and len(calls) == 1
    with pytest.raises(RuntimeError, match="accel=kvm"):
        choose_accel(hv, image, "kvm", cache)
    blocked = tmp_path / "file" / "accel.json"  # its parent is a file: no cache can be written
    (tmp_path / "file").write_text("")
    assert choose_accel(hv, image, "auto", blocked) == ("tcg", "probe guest hung") and len(calls) == 3


def test_the_probe_verdict_is_the_hosts_not_a_state_dirs(tmp_path: Path) -> None:
    from kernelhost.config import Settings

    one = Settings(state_dir=tmp_path / "a", image_dir=tmp_path / "images")
    other = Settings(state_dir=tmp_path / "b", image_dir=tmp_path / "images")
    assert one.accel_cache_file == other.accel_cache_file == tmp_path / "images" / ".accel.json"


def test_unreachable_libvirt_names_the_uri(tmp_path: Path) -> None:
    from hypervisor import LibvirtUnavailable

    h = Hypervisor("qemu+unix:///system?socket=/nonexistent/sock", "kh-", tmp_path)
    with pytest.raises(LibvirtUnavailable) as err:
        h.versions()
    assert "/nonexistent/sock" in str(err.value) and "start-libvirt" in str(err.value)
    assert isinstance(err.value.__cause__, libvirt.libvirtError)


def test_destroy_that_fails_while_libvirt_is_away_is_retried(hv: Hypervisor, image: GuestImage) -> None:
    from hypervisor import HypervisorError

    class Away:  # a connection whose daemon went away: it says alive, every call fails
        def isAlive(self) -> int:
            return 1

        def getLibVersion(self) -> int:  # it went away between this check and the lookup
            return 9_000_000

        def lookupByName(self, name: str) -> None:
            raise libvirt.libvirtError("End of file while reading data: Input/output error")

    name = hv.new_name()
    hv.start(hv.spec_for(name, image, accel="tcg", memory_mib=256, vcpus=1))
    real, hv._conn = hv._conn, Away()
    with pytest.raises(HypervisorError, match=name):
        hv.destroy(name)
    assert hv.pending_destroys == 1
    assert hv.retry_destroys() == [] and hv.pending_destroys == 1  # still away: kept
    hv._conn = real  # back
    assert hv.is_running(name)
    assert hv.retry_destroys() == [name]
    assert hv.pending_destroys == 0
    assert not hv.is_running(name) and not hv.vm_dir(name).exists()


def test_device_model_changes_with_the_machine_not_with_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from hypervisor import device_model
    from hypervisor import domain as domain_mod

    first = device_model()
    assert first == device_model()
    original = DomainSpec.to_xml
    monkeypatch.setattr(
        domain_mod.DomainSpec,
        "to_xml",
        lambda self, virt_type=None: original(self).replace("virtio-serial", "virtio-serial2"),
    )
    assert device_model() != first
