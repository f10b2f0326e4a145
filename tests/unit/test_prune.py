"""Pruning of stale template snapshots and image builds (kernelhost/sandboxes/vm/prune.py) and
``kernelhost prune``, on temporary directories."""

from __future__ import annotations

import json
import mmap
import os
import time
from pathlib import Path

import pytest

from hypervisor import ImageStore
from kernelhost import cli
from kernelhost.sandboxes import SandboxRecord, SandboxState
from kernelhost.sandboxes.store import Store
from kernelhost.sandboxes.vm.prune import InUse, apply, scan_in_use, stale_images, stale_snapshots
from kernelhost.sandboxes.vm.snapshots import snapshot_key

pytestmark = pytest.mark.unit

VERSIONS = {"libvirt": "9.0.0", "hypervisor": "7.2.0"}


def image(images: Path, template: str, key: str, current: bool = False) -> Path:
    path = images / f"{template}-{key}"
    path.mkdir(parents=True)
    (path / "rootfs.erofs").write_bytes(b"r" * 8192)
    (path / "manifest.json").write_text(json.dumps({"template": template, "key": key}))
    if current:
        (images / template).symlink_to(path.name)
    return path


def snapshot(
    ram: Path, template: str, image_key: str, memory_mib: int = 512, versions: dict[str, str] = VERSIONS
) -> Path:
    key = snapshot_key(image_key, versions, memory_mib, 1, "tcg")
    path = ram / "templates" / f"{template}-{memory_mib}m1ctcg-{key}"
    path.mkdir(parents=True)
    (path / "ram").write_bytes(b"m" * 16384)
    (path / "state").write_bytes(b"s" * 4096)
    (path / "meta.json").write_text(
        json.dumps(
            {
                "template": template,
                "key": key,
                "image_key": image_key,
                "memory_mib": memory_mib,
                "vcpus": 1,
                "accel": "tcg",
            }
        )
    )
    return path


def old(path: Path) -> Path:
    """A directory last touched two hours ago (an abandoned build)."""
    path.mkdir(parents=True, exist_ok=True)
    then = time.time() - 2 * 3600
    os.utime(path, (then, then))
    return path


@pytest.fixture
def host(tmp_path: Path) -> tuple[Path, Path]:
    images, ram = tmp_path / "images", tmp_path / "ram"
    image(images, "python", "new", current=True)
    image(images, "python", "old")
    return images, ram


def test_only_snapshots_no_clone_will_start_from_go(host: tuple[Path, Path]) -> None:
    images, ram = host
    current = snapshot(ram, "python", "new")
    other_shape = snapshot(ram, "python", "new", memory_mib=1536)  # another service's size
    stale = snapshot(ram, "python", "old")
    gone = snapshot(ram, "ruby", "r1")  # its template has no image any more
    upgraded = snapshot(
        ram, "python", "new", memory_mib=1024, versions={"libvirt": "8.0.0", "hypervisor": "6.2.0"}
    )
    broken = ram / "templates" / "python-512m1ctcg-0123456789abcdef"
    broken.mkdir()
    abandoned = old(ram / "templates" / ".build-python-x-1a2b3c")
    fresh_build = ram / "templates" / ".build-python-y-4d5e6f"
    fresh_build.mkdir()

    plan = stale_snapshots(ram, ImageStore(images), InUse(), VERSIONS)
    removed = {a.path for a in plan.remove}
    assert removed == {stale, gone, upgraded, broken, abandoned}
    assert "current is python-new" in next(a.reason for a in plan.remove if a.path == stale)
    assert plan.bytes >= 16384 + 4096
    # without libvirt's versions, the image build alone decides
    assert {a.path for a in stale_snapshots(ram, ImageStore(images), InUse()).remove} == (
        removed - {upgraded}
    )

    freed = apply(plan)
    assert freed == plan.bytes
    left = set((ram / "templates").iterdir())
    assert left == {current, other_shape, fresh_build}


def test_a_snapshot_a_running_vm_maps_is_kept(host: tuple[Path, Path]) -> None:
    images, ram = host
    stale = snapshot(ram, "python", "old")
    with (stale / "ram").open("r+b") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE) as m:
        assert m[:1] == b"m"
        in_use = scan_in_use()  # this very process maps it, as a clone's QEMU would
        assert in_use.holds(stale) and not in_use.uncertain
        plan = stale_snapshots(ram, ImageStore(images), in_use)
    assert plan.remove == []
    assert [(a.path, why) for a, why in plan.keep] == [(stale, "mapped by a running VM (a clone of it)")]
    # once its clones are gone, the next prune removes it
    assert [a.path for a in stale_snapshots(ram, ImageStore(images), scan_in_use()).remove] == [stale]


def test_a_snapshot_a_checkpoint_was_taken_over_is_kept_until_the_checkpoint_goes(
    host: tuple[Path, Path],
) -> None:
    images, ram = host
    stale = snapshot(ram, "python", "old")
    (stale / "pins").mkdir()
    (stale / "pins" / "cp_0123456789abcdef").touch()
    plan = stale_snapshots(ram, ImageStore(images), InUse())
    assert plan.remove == []
    assert [(a.path, why) for a, why in plan.keep] == [(stale, "checkpoints were taken over it (pins/)")]
    (stale / "pins" / "cp_0123456789abcdef").unlink()  # the checkpoint was deleted
    assert [a.path for a in stale_snapshots(ram, ImageStore(images), InUse()).remove] == [stale]


def test_images_named_by_records_or_in_use_are_kept(tmp_path: Path) -> None:
    images = tmp_path / "images"
    current = image(images, "python", "new", current=True)
    hibernated = image(images, "python", "hib")
    running = image(images, "python", "run")
    unused = image(images, "python", "old")
    abandoned = old(images / ".build-python-zzz")
    with (running / "rootfs.erofs").open("rb"):  # QEMU keeps its VM's root file open
        plan = stale_images(ImageStore(images), [("python", "hib")], scan_in_use())
    assert {a.path for a in plan.remove} == {unused, abandoned}
    kept = {a.path: why for a, why in plan.keep}
    assert kept == {
        hibernated: "named by a sandbox record (a wake or fork needs it)",
        running: "in use by a running VM",
    }
    assert current not in kept
    uncertain = InUse(uncertain="cannot inspect qemu-system-x86 (pid 1); run as root")
    # when a VM's process cannot be inspected, nothing it could be using goes
    assert stale_images(ImageStore(images), [], uncertain).remove == []


def test_a_built_templates_layer_keeps_its_base_in_the_shared_image_dir(tmp_path: Path) -> None:
    images, built = tmp_path / "images", tmp_path / "state" / "images"
    image(images, "python", "new", current=True)
    base = image(images, "python", "old")  # no longer current, but a template's layer sits on it
    layer = image(built, "kit@key_1", "k1", current=True)
    (layer / "layer.erofs").write_bytes(b"l" * 4096)
    (layer / "manifest.json").write_text(
        json.dumps({"template": "kit@key_1", "key": "k1", "base": base.name})
    )
    stale_layer = image(built, "kit@key_1", "k0")
    store = ImageStore(images, built)
    assert store.get("kit@key_1").base_path == base and store.get("kit@key_1").layers == (
        layer / "layer.erofs",
    )
    assert store.templates() == ["kit@key_1", "python"]
    plan = stale_images(store, [], scan_in_use())
    assert {a.path for a in plan.remove} == {stale_layer}
    assert dict((a.path, why) for a, why in plan.keep) == {
        base: "the base of the template layer kit@key_1-k1"
    }


def test_prune_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    images, ram, state = tmp_path / "images", tmp_path / "ram", tmp_path / "state"
    image(images, "python", "new", current=True)
    hib = image(images, "python", "hib")
    unused = image(images, "python", "old")
    stale_snap = snapshot(ram, "python", "old")
    state.mkdir()
    store = Store(state / "kernelhost.sqlite3")
    store.insert(
        SandboxRecord(
            id="sbx_1",
            owner="key_1",
            template="python",
            domain="kh-1",
            state=SandboxState.HIBERNATED,
            created_at=0.0,
            last_active_at=0.0,
            idle_timeout_seconds=60,
            memory_mib=512,
            vcpus=1,
            accel="tcg",
            image_key="hib",
        )
    )
    store.close()
    for name, value in {
        "IMAGE_DIR": images,
        "RAM_DIR": ram,
        "STATE_DIR": state,
        "RUN_DIR": tmp_path / "run",
        "LIBVIRT_URI": "test:///default",
        "CONFIG": tmp_path / "none.toml",
    }.items():
        monkeypatch.setenv(f"KERNELHOST_{name}", str(value))
    (tmp_path / "none.toml").write_text("")

    assert cli.main(["prune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove snapshot {stale_snap}" in out
    assert f"would remove image    {unused}" in out
    assert f"kept     image    {hib}" in out and "named by a sandbox record" in out
    assert "would free" in out and stale_snap.exists() and unused.exists()

    assert cli.main(["prune"]) == 0
    out = capsys.readouterr().out
    assert f"removed      snapshot {stale_snap}" in out and "kernelhost prune: freed" in out
    assert not stale_snap.exists() and not unused.exists() and hib.exists()
    assert cli.main(["prune"]) == 0
    assert "freed 0 B (0 artifacts)" in capsys.readouterr().out
