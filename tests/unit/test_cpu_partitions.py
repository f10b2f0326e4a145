"""CPU partitions per key (hypervisor/cgroups.py) on a directory standing in for /sys/fs/cgroup,
and the domain XML that puts a VM in one."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from hypervisor import DomainSpec, cgroups
from hypervisor.cgroups import Partitions, PartitionsUnavailable, weight_value

pytestmark = pytest.mark.unit


def fake_rmdir(path: Path) -> None:
    """cgroupfs's rmdir: control files go with the group; a group with tasks or sub-groups is
    busy."""
    if any(p.is_dir() for p in path.iterdir()):
        raise OSError(errno.ENOTEMPTY, "sub-groups", str(path))
    tasks = path / "tasks"
    if tasks.exists() and tasks.read_text().strip():
        raise OSError(errno.EBUSY, "tasks", str(path))
    for f in path.iterdir():
        f.unlink()
    path.rmdir()


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cgroup v1 host as this one: cpu, cpuset, memory and a controller-less unified
    hierarchy, each with libvirt's machine partition; cpuacct mounted but unused."""
    monkeypatch.setattr(cgroups, "rmdir", fake_rmdir)
    (tmp_path / "cpu" / "machine").mkdir(parents=True)
    (tmp_path / "cpu" / "cpu.shares").write_text("1024\n")
    (tmp_path / "cpu" / "machine" / "cpu.shares").write_text("1024\n")
    (tmp_path / "cpuset" / "machine").mkdir(parents=True)
    (tmp_path / "cpuset" / "machine" / "cpuset.cpus").write_text("0-1\n")
    (tmp_path / "cpuset" / "machine" / "cpuset.mems").write_text("0\n")
    (tmp_path / "memory" / "machine").mkdir(parents=True)
    (tmp_path / "cpuacct").mkdir()
    (tmp_path / "unified" / "machine").mkdir(parents=True)
    (tmp_path / "unified" / "cgroup.controllers").write_text("\n")
    return tmp_path


def libvirt_starts(root: Path, partition: str, domain: str, n: int = 7) -> Path:
    """What libvirt does at a domain's start: its groups under the partition, in every
    hierarchy; the v1 CPU group with emulator and vcpu0 sub-groups holding threads."""
    name = partition.removeprefix("/machine/") + cgroups.SUFFIX
    for h in ("cpu", "cpuset", "memory", "unified"):
        assert (root / h / "machine" / name).is_dir(), f"libvirt needs {h}/machine/{name}"
        (root / h / "machine" / name / f"qemu-{n}-{domain}.libvirt-qemu").mkdir()
    group = root / "cpu" / "machine" / name / f"qemu-{n}-{domain}.libvirt-qemu"
    for sub, tids, quota in (("emulator", "100\n101\n", "-1"), ("vcpu0", "102\n", "50000")):
        (group / sub).mkdir()
        (group / sub / "tasks").write_text(tids)
        (group / sub / "cpu.cfs_quota_us").write_text(quota + "\n")
    return group


def libvirt_stops(group: Path) -> None:
    """libvirt removes its (by now emptied) groups when the domain stops."""
    for sub in group.iterdir():
        if sub.is_dir():
            (sub / "tasks").write_text("")
            fake_rmdir(sub)
    fake_rmdir(group)


def partitions(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.glob("*/machine/*.partition"))


def test_a_keys_partition_is_made_in_every_hierarchy_before_its_first_vm(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    assert parts.place("kh-aaa", "key_0123456789ab") == "/machine/kh-key_0123456789ab"
    assert partitions(root) == [
        f"{h}/machine/kh-key_0123456789ab.partition" for h in ("cpu", "cpuset", "memory", "unified")
    ], "a partition in each hierarchy libvirt uses (where its machine partition is), none else"
    made = root / "cpu" / "machine" / "kh-key_0123456789ab.partition"
    assert (made / "cpu.shares").read_text() == "1024\n", "weight 100 is v1's default 1024 shares"
    cpuset = root / "cpuset" / "machine" / "kh-key_0123456789ab.partition"
    assert (cpuset / "cpuset.cpus").read_text() == "0-1\n", "an empty cpuset would refuse QEMU"
    assert (cpuset / "cpuset.mems").read_text() == "0\n"


def test_the_weight_is_in_each_hierarchys_unit() -> None:
    assert weight_value(100, v2=True) == 100
    assert weight_value(100, v2=False) == 1024
    assert weight_value(50, v2=False) == 512
    assert weight_value(1, v2=False) == 10, "1% of the default"
    assert weight_value(10000, v2=False) == 102400


def test_on_a_v2_host_the_weight_is_cpu_weight_and_controllers_pass_down(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "machine").mkdir()
    (tmp_path / "machine" / "cpu.weight").write_text("100\n")
    (tmp_path / "machine" / "cgroup.subtree_control").write_text("cpu memory\n")
    parts = Partitions.detect("kh-", 250, tmp_path)
    assert parts.place("kh-aaa", "key_x") == "/machine/kh-key_x"
    made = tmp_path / "machine" / "kh-key_x.partition"
    assert (made / "cpu.weight").read_text() == "250\n"
    assert (made / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert not parts.can_move, "a thread move is a v1 operation here"


def test_vms_of_no_key_share_the_services_partition_and_names_are_checked(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    assert parts.place("kh-pool1", None) == "/machine/kh-service"
    for bad in ("kh_abc/../x", "", "../etc", "a b", "kh_0123456789ab\n"):
        with pytest.raises(ValueError, match="plain identifier"):
            parts.place("kh-x", bad)


def test_a_partition_goes_with_its_keys_last_vm(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    one = libvirt_starts(root, str(parts.place("kh-one", "key_a")), "kh-one", 1)
    two = libvirt_starts(root, str(parts.place("kh-two", "key_a")), "kh-two", 2)
    libvirt_stops(one)
    parts.release("kh-one")
    assert "cpu/machine/kh-key_a.partition" in partitions(root), "kh-two still runs in it"
    libvirt_stops(two)
    parts.release("kh-two")
    assert partitions(root) == [], "the key's last VM is gone: so is its partition, everywhere"
    parts.release("kh-two")  # idempotent


def test_a_partition_placed_for_a_starting_vm_is_not_pruned_under_it(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    one = libvirt_starts(root, str(parts.place("kh-one", "key_a")), "kh-one", 1)
    parts.place("kh-two", "key_a")  # placed; libvirt has not made its group yet
    libvirt_stops(one)
    parts.release("kh-one")
    assert "cpu/machine/kh-key_a.partition" in partitions(root)


def test_a_handed_over_vm_moves_to_its_keys_partition_with_its_limits(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    group = libvirt_starts(root, str(parts.place("kh-pool1", None)), "kh-pool1")
    assert parts.can_move
    assert parts.move("kh-pool1", "key_b")
    copy = root / "cpu" / "machine" / "kh-key_b.partition" / group.name
    assert (copy / "vcpu0" / "tasks").read_text() == "102\n"
    assert (copy / "vcpu0" / "cpu.cfs_quota_us").read_text() == "50000\n", "its vCPU quota kept"
    assert (copy / "emulator" / "tasks").read_text().strip() in ("100", "101")
    assert parts.owners() == {"kh-pool1": "kh-key_b"}
    assert not parts.move("kh-pool1", "key_b"), "already there"
    libvirt_stops(group)  # the real kernel emptied it by the move; libvirt removes it
    for sub in ("emulator", "vcpu0"):
        (copy / sub / "tasks").write_text("")  # QEMU exited
    parts.release("kh-pool1")
    assert partitions(root) == [], "the copied groups and both partitions are gone"


def test_a_restart_takes_back_partitions_that_hold_vms_and_drops_empty_ones(root: Path) -> None:
    before = Partitions.detect("kh-", 100, root)
    group = libvirt_starts(root, str(before.place("kh-live", "key_a")), "kh-live")
    before.place("kh-gone", "key_b")  # the service was killed before this one started
    other = Partitions.detect("kx-", 100, root)
    other.place("kx-1", "key_c")  # another service's: not ours to touch
    after = Partitions.detect("kh-", 100, root)
    assert after.adopt() == ["kh-key_b"]
    assert after.owners() == {"kh-live": "kh-key_a"}
    assert "cpu/machine/kx-key_c.partition" in partitions(root)
    libvirt_stops(group)
    after.release("kh-live")
    assert after.close() == []
    assert [p for p in partitions(root) if "/kh-" in p] == [], "no partition of ours left"


def test_close_leaves_partitions_whose_vms_run_on(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    libvirt_starts(root, str(parts.place("kh-live", "key_a")), "kh-live")
    parts.place("kh-x", None)
    parts.release("kh-x")
    assert parts.close() == []
    assert "cpu/machine/kh-key_a.partition" in partitions(root), "its VM runs for the next start"


def test_no_cpu_controller_or_no_permission_is_reported_not_raised_later(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(PartitionsUnavailable, match="no cgroup CPU controller"):
        Partitions.detect("kh-", 100, bare)

    def refuse(self: Path, *args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refuse)
    with pytest.raises(PartitionsUnavailable, match=r"cannot make a cgroup in .*Permission denied"):
        Partitions.detect("kh-", 100, root)


def test_before_libvirts_first_vm_there_is_no_partition_yet(root: Path) -> None:
    parts = Partitions.detect("kh-", 100, root)
    for h in ("cpu", "cpuset", "memory", "unified"):
        for f in (root / h / "machine").iterdir():
            f.unlink()
        (root / h / "machine").rmdir()
    assert parts.place("kh-a", "key_a") is None, "the VM starts in libvirt's default partition"


def spec(**kw: object) -> DomainSpec:
    base: dict[str, object] = dict(
        name="kh-x", uuid="00000000-0000-0000-0000-000000000000", kernel=Path("k"),
        initrd=Path("i"), rootfs=Path("r"), channel_socket=Path("s"), console_log=Path("c"),
    )  # fmt: skip
    return DomainSpec(**{**base, **kw})  # type: ignore[arg-type]


def test_the_domain_xml_names_its_partition() -> None:
    xml = spec(partition="/machine/kh-key_0123456789ab").to_xml()
    assert "<resource><partition>/machine/kh-key_0123456789ab</partition></resource>" in xml
    assert "<resource>" not in spec().to_xml(), "no partition: libvirt's default"
    with pytest.raises(ValueError, match="partition must be /machine/NAME"):
        spec(partition="/machine/../x")
    with pytest.raises(ValueError, match="partition must be /machine/NAME"):
        spec(partition="machine/x")
