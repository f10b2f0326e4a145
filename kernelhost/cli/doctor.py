"""``kernelhost doctor``: check the host the service runs on, and say what to fix.

It inspects the host directly (libvirt, QEMU, the acceleration probe, the guest images, the
tmpfs that holds VM memory) with the service's own settings, so it works while the service is
down, which is when it is needed most.
"""

from __future__ import annotations

import json
import platform
import shutil
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import Settings

MIN_SHM_FREE_MIB = 1024  # a template's RAM file plus a few clones' private pages


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    warning: bool = False  # a problem that slows or limits the service but does not stop it

    def line(self) -> str:
        mark = "ok  " if self.ok else ("warn" if self.warning else "FAIL")
        text = f"{mark} {self.name}: {self.detail}"
        return text + (f"\n       fix: {self.fix}" if self.fix and not self.ok else "")


def run_checks(settings: Settings, probe_timeout: float = 20.0) -> list[Check]:
    """Every check, in the order a broken host should be repaired."""
    from hypervisor import Hypervisor, ImageStore, LibvirtUnavailable, choose_accel

    checks = [_qemu()]
    hv = Hypervisor(settings.libvirt_uri, settings.domain_prefix, settings.run_dir)
    try:
        try:
            v = hv.versions()
            checks.append(
                Check(
                    "libvirt",
                    True,
                    f"{settings.libvirt_uri} answers (libvirt {v['libvirt']}, hypervisor {v['hypervisor']})",
                )
            )
            reachable = True
        except LibvirtUnavailable as exc:
            checks.append(
                Check(
                    "libvirt",
                    False,
                    str(exc),
                    "start libvirt's daemons ('make serve' does; or systemctl start libvirtd "
                    "virtqemud), or point KERNELHOST_LIBVIRT_URI at a running one",
                )
            )
            reachable = False
        images = ImageStore(settings.image_dir, settings.built_image_dir)
        templates = [t for t in images.templates() if "@" not in t and not images.get(t).layers]
        if templates:
            checks.append(Check("images", True, f"{', '.join(templates)} in {settings.image_dir}"))
            checks.append(_templates(settings))
        else:
            checks.append(
                Check(
                    "images",
                    False,
                    f"no guest image in {settings.image_dir}",
                    "run 'make image' (about a minute the first time)",
                )
            )
        if templates:
            checks.append(_snapshots(settings, images, templates))
        checks.append(_stale(settings, images, v if reachable else None))
        if not reachable or not templates:
            checks.append(
                Check(
                    "acceleration",
                    False,
                    "not probed: needs libvirt and an image",
                    "fix the checks above first",
                )
            )
        else:
            checks.append(
                _accel(
                    lambda: choose_accel(
                        hv,
                        images.get(templates[0]),
                        settings.accel,
                        settings.accel_cache_file,
                        timeout=probe_timeout,
                    )
                )
            )
    finally:
        hv.close()
    checks.append(_shm(settings.ram_dir, settings.vm_memory_mib))
    checks.append(_live_checkpoints(settings.live_checkpoints))
    checks.append(_service(settings.url))
    return checks


def _templates(settings: Settings) -> Check:
    """The operator's and the keys' templates, by state, as the service's records have them."""
    from ..sandboxes.store.db import SQLite
    from ..sandboxes.store.migrations import SchemaTooNew
    from ..sandboxes.store.templates import TemplateStore

    if not settings.db_path.is_file():
        return Check("templates", True, "no template built yet (docs/templates.md)")
    db = SQLite(settings.db_path)
    try:
        records = TemplateStore(db).all()
    except SchemaTooNew as exc:  # what the service would refuse at start
        return Check("templates", False, str(exc), "upgrade kernelhost on this node")
    finally:
        db.close()
    operator = [f"{r.name} ({r.state})" for r in records if not r.owner]
    keys: dict[str, int] = {}
    for r in records:
        if r.owner:
            keys[r.state] = keys.get(r.state, 0) + 1
    failed = [f"{r.name}: {r.error}" for r in records if r.state == "failed" and not r.owner]
    detail = f"operator's: {', '.join(operator) or 'none'}; API keys': " + (
        ", ".join(f"{n} {state}" for state, n in sorted(keys.items())) or "none"
    )
    if failed:
        return Check(
            "templates", False, detail + "; " + "; ".join(failed), "fix the spec files in template_dir"
        )
    return Check("templates", True, detail)


def _snapshots(settings: Settings, images: Any, templates: list[str]) -> Check:
    """Whether each template's current image has a template snapshot (clones start from it)."""
    built: list[str] = []
    missing: list[str] = []
    base = settings.ram_dir / "templates"
    for template in templates:
        key = images.get(template).key
        shapes = []
        for meta_file in sorted(base.glob(f"{template}-*/meta.json")) if base.is_dir() else []:
            try:
                meta = json.loads(meta_file.read_text())
            except (OSError, ValueError):
                continue
            if meta.get("template") == template and meta.get("image_key") == key:
                shapes.append(f"{meta.get('memory_mib')} MiB {meta.get('accel')}")
        (built if shapes else missing).append(f"{template} ({', '.join(shapes)})" if shapes else template)
    if not missing:
        return Check("snapshots", True, "built: " + "; ".join(built))
    return Check(
        "snapshots",
        False,
        f"not built yet for {', '.join(missing)}" + (f"; built: {'; '.join(built)}" if built else ""),
        "nothing to do: the service builds them at start-up (about 10 s each under "
        "TCG, shown as a progress bar on a terminal)",
        warning=True,
    )


def _stale(settings: Settings, images: Any, versions: dict[str, str] | None) -> Check:
    """Old image builds and template snapshots that 'kernelhost prune' would remove."""
    from ..progress import format_bytes
    from ..sandboxes.vm.prune import referenced_builds, scan_in_use, stale_images, stale_snapshots

    referenced = referenced_builds(settings.db_path)
    in_use = scan_in_use()
    snaps = stale_snapshots(settings.ram_dir, images, in_use, versions)
    builds = stale_images(images, referenced, in_use)
    if not snaps.remove and not builds.remove:
        return Check("stale builds", True, "none")
    return Check(
        "stale builds",
        False,
        f"{len(builds.remove)} old image builds ({format_bytes(builds.bytes)} of disk), "
        f"{len(snaps.remove)} stale template snapshots ({format_bytes(snaps.bytes)} in "
        f"{settings.ram_dir}, RAM)",
        "run 'kernelhost prune' (--dry-run lists them)",
        warning=True,
    )


def _service(url: str) -> Check:
    """Whether the service answers at its configured address (a warning only: doctor is for
    when it does not start, too)."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as r:
            health = json.loads(r.read())
    except (OSError, ValueError) as exc:
        return Check(
            "service",
            False,
            f"nothing answers at {url} ({exc})",
            "start it with 'kernelhost serve' (or 'make serve')",
            warning=True,
        )
    return Check(
        "service",
        True,
        f"{url} answers: accel {health.get('accel')}, "
        f"{health.get('sandboxes')} sandboxes, pool {health.get('pool')}",
    )


def _qemu() -> Check:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(platform.machine().lower(), platform.machine())
    binary = f"qemu-system-{arch}"
    path = shutil.which(binary) or next(
        (p for p in (f"/usr/bin/{binary}", f"/usr/libexec/{binary}") if Path(p).exists()), None
    )
    if path:
        return Check("qemu", True, path)
    package = "qemu-system-x86" if arch == "x86_64" else "qemu-system-arm"
    return Check("qemu", False, f"{binary} not found", f"apt-get install {package} (or run 'make deps')")


def _accel(probe: Callable[[], tuple[str, str]]) -> Check:
    try:
        accel, reason = probe()
    except RuntimeError as exc:  # accel=kvm configured, and KVM cannot boot a guest
        return Check(
            "acceleration",
            False,
            str(exc),
            "set KERNELHOST_ACCEL=auto (falls back to TCG) or repair KVM on this host",
        )
    reason = " ".join(reason.split())  # QEMU's error output spans lines
    reason = reason if len(reason) <= 300 else reason[:297] + "..."
    if accel == "kvm":
        return Check("acceleration", True, f"kvm ({reason})")
    return Check(
        "acceleration",
        False,
        f"tcg, software emulation ({reason}); sandboxes work but run several times slower",
        "use a host where KVM can boot a guest (bare metal, or nested virtualization enabled)",
        warning=True,
    )


def _live_checkpoints(mode: str, sysctl: Path = Path("/proc/sys/vm/unprivileged_userfaultfd")) -> Check:
    """QEMU (as libvirt's unprivileged user) may use userfaultfd only with this sysctl on."""
    if mode == "off":
        return Check("live checkpoints", True, "off: a checkpoint pauses its VM while it is saved")
    try:
        on = sysctl.read_text().strip() == "1"
    except OSError:
        on = False
    if on:
        return Check("live checkpoints", True, "QEMU may use userfaultfd: a checkpoint pauses its VM for ms")
    return Check(
        "live checkpoints",
        False,
        "live_checkpoints is on but vm.unprivileged_userfaultfd is 0: checkpoints pause their VM "
        "while it is saved instead",
        "sysctl vm.unprivileged_userfaultfd=1 ('make serve' sets it when KERNELHOST_LIVE_CHECKPOINTS"
        "=on; docs/checkpoints.md), or live_checkpoints = off",
        warning=True,
    )


def _shm(ram_dir: Path, vm_memory_mib: int) -> Check:
    where = ram_dir if ram_dir.exists() else ram_dir.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError as exc:
        return Check(
            "vm memory tmpfs",
            False,
            f"{where}: {exc}",
            f"mount a tmpfs at {ram_dir.parent} or set KERNELHOST_RAM_DIR",
        )
    free_mib = usage.free // (1024 * 1024)
    need = max(MIN_SHM_FREE_MIB, 2 * vm_memory_mib)
    detail = f"{free_mib} MiB free of {usage.total // (1024 * 1024)} MiB in {where}"
    if free_mib >= need:
        return Check("vm memory tmpfs", True, detail)
    return Check(
        "vm memory tmpfs",
        False,
        detail + f"; need at least {need} MiB",
        f"grow it (mount -o remount,size=4G {where}) or remove stale files in {ram_dir}",
    )
