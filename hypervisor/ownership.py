"""Who owns the files QEMU is given (docs/security.md, "If a guest escaped into QEMU").

QEMU runs as libvirt's unprivileged user. What it must write is given to that user
(``give_to_qemu``: a VM's directory, the RAM of a template VM while it is built, a fork's RAM).
What every tenant's VM starts from stays root's and read-only to it (``keep_from_qemu``): the
images (kernel, initramfs, root, layers) and a template snapshot once frozen. libvirt's DAC
driver would otherwise chown a domain's kernel, initramfs and disks to its QEMU user at every
start (``dynamic_ownership``), and never give the shared read-only disks back; domains are
therefore started with a static DAC label that libvirt does not relabel files for
(``dac_label``, rendered by ``DomainSpec``): QEMU still runs as the same user and group.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
from pathlib import Path
from xml.etree import ElementTree

import libvirt

QEMU_USER = "libvirt-qemu"
QEMU_BINARY = "qemu-system-x86_64"
PROBE_TIMEOUT = 20.0  # seconds the read-only RAM probe's QEMU may take


def qemu_ids() -> tuple[int, int] | None:
    """The uid and gid of libvirt's QEMU user, or None where there is none."""
    try:
        pw = pwd.getpwnam(QEMU_USER)
    except KeyError:
        return None
    return pw.pw_uid, pw.pw_gid


def give_to_qemu(path: Path, mode: int = 0o750) -> None:
    """QEMU runs as libvirt's unprivileged user: ``path`` (a directory it writes in, or a file
    it maps, ``mode`` 0o600) becomes that user's."""
    ids = qemu_ids()
    if ids is None:
        return
    with contextlib.suppress(PermissionError):
        os.chown(path, *ids)
    path.chmod(mode)


def keep_from_qemu(path: Path, mode: int = 0o644) -> None:
    """``path`` becomes root's, with ``mode`` (0o644 for a file QEMU reads, 0o755 for a directory
    it passes through); a no-op when it is already so (cheap enough for every VM start)."""
    st = path.stat()
    if st.st_uid == 0 and st.st_gid == 0 and st.st_mode & 0o7777 == mode:
        return
    with contextlib.suppress(PermissionError):  # a service not run as root cannot
        os.chown(path, 0, 0)
    path.chmod(mode)


def keep_images_from_qemu(*paths: Path) -> None:
    """The files of an image (or several): root's, 0644, where they exist (``keep_from_qemu``),
    unless they already are root's, writable by nobody else and readable by QEMU (a tenant's
    template layer is root's with mode 0640, readable through QEMU's group only: it stays so)."""
    ids = qemu_ids()
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            st = path.stat()
            by_group = ids is not None and st.st_gid == ids[1] and st.st_mode & 0o040
            if st.st_uid == 0 and not st.st_mode & 0o022 and (st.st_mode & 0o004 or by_group):
                continue
            keep_from_qemu(path)


def dac_label(conn: libvirt.virConnect) -> str:
    """libvirt's own DAC label for QEMU domains (``+uid:+gid``, from its capabilities): started
    with it as a static label and ``relabel='no'``, a domain's QEMU runs as usual and libvirt
    chowns none of its files. '' where the host has no DAC security model (the test driver)."""
    try:
        caps = ElementTree.fromstring(conn.getCapabilities())
    except (libvirt.libvirtError, ElementTree.ParseError):
        return ""
    for model in caps.iter("secmodel"):
        if (model.findtext("model") or "") != "dac":
            continue
        labels = {b.get("type"): (b.text or "").strip() for b in model.iter("baselabel")}
        return labels.get("qemu") or labels.get("kvm") or ""
    return ""


def private_ram_may_be_read_only(directory: Path) -> bool:
    """Whether this host's QEMU, as its unprivileged user, maps a guest RAM file it may only read
    (``share=off``: copy-on-write). QEMU 7.2 opens that file read-write even for a private mapping,
    so a template's RAM file must stay writable to its user there; newer QEMUs fall back to
    read-only. Probed once with a QEMU that creates the memory backend and quits."""
    ids = qemu_ids()
    if ids is None or os.geteuid() != 0:
        return False
    probe = directory / f".ro-probe-{os.getpid()}"
    try:
        with probe.open("wb") as f:
            f.truncate(2 << 20)
        keep_from_qemu(probe, 0o644)
        backend = f"memory-backend-file,id=m,size=2M,mem-path={probe},share=off"
        args = [QEMU_BINARY, "-machine", "none", "-nodefaults", "-display", "none", "-object", backend]
        done = subprocess.run(
            [*args, "-qmp", "stdio"],
            input='{"execute": "qmp_capabilities"}\n{"execute": "quit"}\n',
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            user=ids[0],
            group=ids[1],
            extra_groups=[],
        )
        return done.returncode == 0 and "can't open backing store" not in done.stderr
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        probe.unlink(missing_ok=True)
