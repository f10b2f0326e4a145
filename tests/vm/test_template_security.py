"""Nothing a tenant puts in a template runs on the host (issue "Nothing a tenant sends runs on
the host", findings 1-6), each attack mounted through the real service and real build VMs:

- a template whose setup command, whose pip package's ``setup.py`` and whose preload module each
  try to read the host's ``/proc/1/root/etc/hostname``, list the host's state directory and
  write a marker file on the host: the build runs in its VM, what they saw is the VM, and no
  marker, no host data and no listing appears on the host or in the build's log;
- ``files_dest`` with ``..`` (refused) and one through the image's ``/var/run -> /run`` symlink
  (resolved in the VM's root: nothing lands in the host's ``/run``);
- a 1,000,000-member bzip2 archive (refused unopened, at once, memory flat) and a
  1,000,000-member tar.gz (the build VM stops at the member cap; the host's memory flat);
- a template over its key's memory limit (refused, naming the limit);
- another key reading and cancelling an operator's build (404);
- what a build leaves: the layer root-owned and not world-readable, the manifest root's only.

It also lists every process the service and libvirt start on the host (``execve``, traced with
strace) during the hostile template's whole build and a sandbox's life, with its argv, into
``results/host-processes.txt``, and checks that none carries the tenant's input.

Fixture graph (module scoped)::

    sec_service ──> host_trace (strace of the service and libvirtd) ──> hostile
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import re
import secrets
import socket
import stat
import subprocess
import tarfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kernelhost import AsyncSandbox, AsyncTemplate, TemplateBuildError

from ..harness import Service, running_service

pytestmark = [pytest.mark.vm, pytest.mark.timeout(1500)]

IMAGE_DIR = Path("/var/cache/kernelhost/images")
DATA = Path(__file__).parent / "data"
MAX_MEMBERS = 2000
OPERATOR_SPEC = 'name = "op-fails"\nsetup = ["echo the operator build fails; exit 4"]\n'


@pytest.fixture(scope="module")
def sec_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    operator = tmp_path_factory.mktemp("sec-operator")
    (operator / "op-fails.toml").write_text(OPERATOR_SPEC)
    with running_service(
        tmp_path_factory.mktemp("sec-templates"),
        "vm-template-security",
        KERNELHOST_TEMPLATE_DIR=str(operator),
        KERNELHOST_MAX_MEMORY_MIB_PER_KEY="6144",
        KERNELHOST_POOL_SIZE="0",
        # the cap the gzip bomb meets, low so the VM stops it in seconds (the default 100000
        # takes minutes under emulation)
        KERNELHOST_TEMPLATE_FILES_MAX_MEMBERS=str(MAX_MEMBERS),
    ) as svc:
        yield svc


@dataclass
class Hostile:
    name: str
    nonce: str
    log: str
    stages: list[str]


def _attack(nonce: str, who: str, state_dir: Path) -> str:
    """Shell that tries to reach the host from a build step: the host's hostname through
    PID 1's root, a listing of the host's state directory (directly and through the parent's
    root), a marker file written through PID 1's root and the parent's root. What it saw is
    kept in the layer (``/opt/seen-<who>``) for the test to read from a sandbox."""
    marker = f"kh-escape-{nonce}-{who}"
    return (
        f"{{ echo hostname: $(cat /proc/1/root/etc/hostname 2>&1); "
        f"echo kernel-hostname: $(cat /proc/1/root/proc/sys/kernel/hostname 2>&1); "
        f"echo listing: $(ls {state_dir} /proc/$PPID/root{state_dir} 2>&1 | head -20); "
        f"touch /proc/1/root/tmp/{marker} /proc/$PPID/root/tmp/{marker}-ppid 2>&1 || :; "
        f"}} > /opt/seen-{who} 2>&1; cat /opt/seen-{who}"
    )


def _evil_sdist(nonce: str, state_dir: Path) -> bytes:
    """A source distribution whose setup.py attacks when pip builds it."""
    setup_py = textwrap.dedent(
        f"""
        import subprocess
        subprocess.run({_attack(nonce, "setup-py", state_dir)!r}, shell=True)
        from setuptools import setup
        setup(name="khevil", version="0.1", py_modules=[])
        """
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, text in (("khevil-0.1/setup.py", setup_py), ("khevil-0.1/PKG-INFO", "Name: khevil\n")):
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def _files_archive(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def _post(svc: Service, key: str, spec: dict[str, Any], archive: bytes) -> tuple[int, dict[str, Any]]:
    form = aiohttp.FormData()
    form.add_field("spec", json.dumps(spec), content_type="application/json")
    form.add_field("files", io.BytesIO(archive), filename="files.tar.gz", content_type="application/gzip")
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{svc.url}/v1/templates", data=form, headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        return r.status, await r.json()


def _service_rss(svc: Service) -> int:
    assert svc.proc is not None
    for line in Path(f"/proc/{svc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass
class Trace:
    proc: subprocess.Popen[bytes]
    path: Path

    def stop(self) -> list[tuple[str, list[str]]]:
        """Stop tracing; every (program, argv) the traced processes started."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(30)
        found = []
        for line in self.path.read_text(errors="replace").splitlines():
            m = re.search(r'execve\("([^"]*)", \[(.*?)\](?:, 0x[0-9a-f]+| /\*)', line)
            if m and "= -1" not in line:
                found.append((m.group(1), re.findall(r'"((?:[^"\\]|\\.)*)"', m.group(2))))
        return found


@pytest.fixture(scope="module")
def host_trace(sec_service: Service, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Trace]:
    """``strace -f -e execve`` of the service and libvirtd (which starts every QEMU)."""
    assert sec_service.proc is not None
    libvirtd = subprocess.run(
        ["pgrep", "-o", "-x", "libvirtd"], capture_output=True, text=True
    ).stdout.split()
    assert libvirtd, "libvirtd is not running"
    path = tmp_path_factory.mktemp("trace") / "execve.trace"
    proc = subprocess.Popen(
        ["strace", "-f", "-qq", "-s", "4096", "-e", "trace=execve", "-o", str(path),
         "-p", str(sec_service.proc.pid), "-p", libvirtd[0]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 10
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)  # strace attaches to every thread
    trace = Trace(proc, path)
    yield trace
    trace.stop()


@pytest.fixture(scope="module")
async def hostile(sec_service: Service, host_trace: Trace) -> AsyncIterator[Hostile]:
    svc, nonce = sec_service, secrets.token_hex(4)
    dest = f"/var/run/kh-{nonce}"  # through the image's /var/run -> /run symlink
    evilmod = f"import subprocess\nsubprocess.run({_attack(nonce, 'preload', svc.state_dir)!r}, shell=True)\n"
    archive = _files_archive(
        {"evilmod.py": evilmod.encode(), "khevil-0.1.tar.gz": _evil_sdist(nonce, svc.state_dir)}
    )
    site = "$(python3 -c 'import site; print(site.getsitepackages()[0])')"
    spec = {
        "name": "hostile",
        "files_dest": dest,
        "setup": [
            _attack(nonce, "setup", svc.state_dir),
            f"cp /run/kh-{nonce}/evilmod.py {site}/",
            "pip install --break-system-packages --no-index --no-build-isolation "
            f"/run/kh-{nonce}/khevil-0.1.tar.gz",
        ],
        "preload": ["evilmod"],
        "env": {"KH_NONCE": nonce},
    }
    status, body = await _post(svc, svc.api_key, spec, archive)
    assert status == 202, body
    stages: list[str] = []
    lines: list[str] = []
    info = await AsyncTemplate.wait(
        "hostile",
        url=svc.url,
        api_key=svc.api_key,
        on_stage=lambda s, d: stages.append(s),
        on_log=lines.append,
    )
    assert info.state == "ready", info
    yield Hostile("hostile", nonce, "\n".join(lines), stages)


async def test_build_steps_run_in_a_vm_and_reach_nothing_of_the_host(
    sec_service: Service, hostile: Hostile
) -> None:
    svc = sec_service
    assert {"vm", "files", "setup", "warm-up", "pack", "snapshot"} <= set(hostile.stages), hostile.stages
    host_name = socket.gethostname()
    # what each attack saw, kept in the layer: the VM's hostname and no host files
    async with AsyncSandbox(template="hostile", url=svc.url, api_key=svc.api_key) as sbx:
        seen = await sbx.run_code('for f in /opt/seen-*; do echo "== $f"; cat $f; done', language="bash")
    for who in ("setup", "setup-py", "preload"):
        assert f"== /opt/seen-{who}" in seen.stdout, (who, seen.stdout)
    assert seen.stdout.count("kernel-hostname: sandbox") == 3, seen.stdout  # the VM's, not the host's
    for text in (seen.stdout, hostile.log):
        assert host_name not in text.split(), f"the host's name {host_name!r} reached the build"
        assert "service.lock" not in text and "service.log" not in text, "the host's state dir was listed"
    # and none was written anywhere on the host (the whole root file system, bounded)
    found = await asyncio.to_thread(
        subprocess.run,
        ["find", "/", "-xdev", "-name", f"kh-escape-{hostile.nonce}*", "-print", "-quit"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert found.stdout == "", f"a build step wrote on the host: {found.stdout}"
    # files_dest through the image's /var/run -> /run symlink resolved inside the VM's root
    assert not Path(f"/run/kh-{hostile.nonce}").exists() and not Path(f"/var/run/kh-{hostile.nonce}").exists()


async def test_no_process_the_host_started_carries_the_tenants_input(
    sec_service: Service, hostile: Hostile, host_trace: Trace
) -> None:
    """After the hostile template's build and a sandbox's life (the test above): every program
    the service and libvirtd started, with its argv, in results/host-processes.txt; none holds
    the tenant's nonce (its setup commands, files, module names and env all carry it)."""
    started = await asyncio.to_thread(host_trace.stop)
    results = Path(__file__).resolve().parents[2] / "results"
    results.mkdir(exist_ok=True)
    listing = "\n".join(f"{prog}  {json.dumps(argv)}" for prog, argv in started)
    (results / "host-processes.txt").write_text(listing + "\n")
    assert any("qemu-system" in prog for prog, _ in started), f"the trace saw no QEMU start:\n{listing}"
    carrying = [(p, a) for p, a in started if hostile.nonce in p or any(hostile.nonce in w for w in a)]
    assert carrying == [], f"host processes carry the tenant's input: {carrying}"


async def test_a_files_dest_with_dot_dot_is_refused(sec_service: Service) -> None:
    svc = sec_service
    status, body = await _post(
        svc,
        svc.api_key,
        {"name": "dotdot", "files_dest": "/home/user/../../etc"},
        _files_archive({"a": b"x"}),
    )
    assert status == 400 and body["error"]["field"] == "files_dest", body
    assert "'..'" in body["error"]["message"]


async def test_a_million_member_bzip2_archive_is_refused_unopened(sec_service: Service) -> None:
    svc = sec_service
    bomb = (DATA / "million-members.tar.bz2").read_bytes()
    with tarfile.open(fileobj=io.BytesIO(bomb[:4096]), mode="r|bz2") as head:  # it is what it says
        assert next(iter(head)).name == "m"
    before = _service_rss(svc)
    t0 = time.monotonic()
    status, body = await _post(svc, svc.api_key, {"name": "bomb"}, bomb)
    took = time.monotonic() - t0
    assert status == 400 and "not gzip-compressed" in body["error"]["message"], body
    assert took < 1.0, f"refusing it took {took:.2f} s"
    assert _service_rss(svc) - before < 20 << 20
    assert not list((svc.state_dir / "template-files").glob("*"))


async def test_a_million_member_tar_gz_stops_at_the_member_cap_in_the_vm(sec_service: Service) -> None:
    svc = sec_service
    info = tarfile.TarInfo("m")
    block = info.tobuf(format=tarfile.GNU_FORMAT)
    raw = gzip.compress(block * 1_000_000 + b"\0" * 1024, 6, mtime=0)
    before = _service_rss(svc)
    status, body = await _post(svc, svc.api_key, {"name": "gzbomb"}, raw)
    assert status == 202, body
    with pytest.raises(TemplateBuildError) as failed:
        await AsyncTemplate.wait("gzbomb", url=svc.url, api_key=svc.api_key)
    assert failed.value.stage == "files" and f"more than {MAX_MEMBERS} members" in str(failed.value), (
        failed.value
    )
    assert _service_rss(svc) - before < 40 << 20
    assert not list((svc.state_dir / "template-files").glob("*")), "the archive outlived its build"
    await AsyncTemplate.delete("gzbomb", url=svc.url, api_key=svc.api_key)


async def test_a_template_over_the_keys_memory_limit_is_refused(sec_service: Service) -> None:
    svc = sec_service
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{svc.url}/v1/templates",
            json={"name": "huge", "memory_mib": 65536},
            headers={"Authorization": f"Bearer {svc.api_key}"},
        ) as r,
    ):
        body = await r.json()
    assert r.status == 429 and body["error"]["limit"] == "max_memory_mib_per_key", body
    assert "6144 MiB" in body["error"]["message"]


async def test_another_key_can_neither_read_nor_cancel_an_operator_build(sec_service: Service) -> None:
    svc = sec_service
    info = await AsyncTemplate.get("op-fails", url=svc.url, api_key=svc.api_key)
    assert info.kind == "operator" and info.build is not None
    build = info.build.id
    headers = {"Authorization": f"Bearer {svc.other_key}"}
    async with aiohttp.ClientSession() as http:
        for method, path in (
            ("GET", f"/v1/templates/op-fails/builds/{build}/logs"),
            ("GET", "/v1/templates/op-fails/builds/latest/logs"),
            ("POST", "/v1/templates/op-fails/cancel"),
            ("POST", f"/v1/templates/op-fails/builds/{build}/cancel"),
        ):
            async with http.request(method, svc.url + path, headers=headers) as r:
                assert r.status == 404, (method, path, r.status, await r.text())


async def test_a_built_layer_is_root_owned_and_not_world_readable(
    sec_service: Service, hostile: Hostile
) -> None:
    svc = sec_service
    image_dir = Path(svc.env.get("KERNELHOST_IMAGE_DIR", str(IMAGE_DIR)))
    found = [p for p in image_dir.glob(f"{hostile.name}@*-*") if (p / "layer.erofs").is_file()]
    assert len(found) == 1, found
    for path, mode in (
        (found[0], 0o750),
        (found[0] / "layer.erofs", 0o640),
        (found[0] / "manifest.json", 0o600),
    ):
        st = path.stat()
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == mode, (path, oct(st.st_mode), st.st_uid)
    # after a clone of it started, too (libvirt must not hand it to QEMU)
    async with AsyncSandbox(template="hostile", url=svc.url, api_key=svc.api_key) as sbx:
        assert (await sbx.run_code("1+1")).text == "2"
        st = (found[0] / "layer.erofs").stat()
        assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o640, oct(st.st_mode)
        await asyncio.sleep(3)  # a shared template's pool would start filling a second after a create
        hv = svc.hypervisor()
        try:
            pooled = [
                d.name
                for d in hv.domains()
                if d.metadata.get("role") == "pool" and d.metadata.get("template", "").startswith("hostile@")
            ]
        finally:
            hv.close()
        assert pooled == [], f"VMs run for the key beside its sandboxes: {pooled}"
