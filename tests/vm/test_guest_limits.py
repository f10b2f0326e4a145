"""Guest limits and a hostile guest, through real VMs.

The code under test is the user's own code: it runs as root in the guest, so it can do whatever a
compromised guest could do short of a QEMU escape. It allocates without bound, fills the disk,
fork-bombs, and takes over the agent's end of the virtio channel to send the host bad frames.
Each time the service must stay up, other sandboxes must not notice, the caller must get a clear
answer, and either the sandbox works again or it is gone with nothing left behind.
"""

from __future__ import annotations

import ast
import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import APIError, NotFoundError

from ..harness import Service

pytestmark = pytest.mark.vm


@pytest.fixture
async def victim(client_env: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(template="python")
    try:
        yield sbx
    finally:
        try:
            await sbx.close()
        except NotFoundError:
            pass  # the service removed it (a protocol violation)


async def _while_other_answers(other: AsyncSandbox, work: asyncio.Future[Any]) -> int:
    """Run ``1 + 1`` on ``other`` until ``work`` is done; how many times it answered."""
    answered = 0
    while not work.done():
        assert (await other.run_code("1 + 1", timeout=120)).text == "2"
        answered += 1
    return answered


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += (Path(dirpath) / name).lstat().st_size
            except OSError:
                pass
    return total


# -- QEMU's confinement -----------------------------------------------------------------------------


async def test_qemu_runs_unprivileged_under_seccomp_with_no_host_share_or_nic(
    service: Service, sandbox: AsyncSandbox
) -> None:
    hv = service.hypervisor()
    try:
        deadline = time.monotonic() + 30
        while not (found := [d for d in hv.domains() if d.metadata.get("sandbox") == sandbox.id]):
            assert time.monotonic() < deadline, "the sandbox's domain never got its label"
            await asyncio.sleep(0.1)
        pid = int(Path(f"/run/libvirt/qemu/{found[0].name}.pid").read_text())
    finally:
        hv.close()
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    status = dict(
        line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line
    )
    sandbox_arg = argv[argv.index("-sandbox") + 1]
    for flag in ("on", "obsolete=deny", "elevateprivileges=deny", "spawn=deny", "resourcecontrol=deny"):
        assert flag in sandbox_arg.split(","), sandbox_arg
    assert status["Uid"].split()[0] != "0" and status["Gid"].split()[0] != "0", status["Uid"]
    assert int(status["CapEff"], 16) == 0 and int(status["CapPrm"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1" or status["Seccomp"].strip() == "2"
    joined = " ".join(argv)
    for shared in (
        "-virtfs",
        "-fsdev",
        "vhost-user-fs",
        "virtio-9p",
        "-netdev",
        "-nic ",
        "usb-uhci",
        "usb-ehci",
        "qemu-xhci",
    ):
        assert shared not in joined, f"QEMU got {shared}: {joined}"


def _qemu_pid(service: Service, sandbox_id: str) -> tuple[str, int]:
    hv = service.hypervisor()
    try:
        [found] = [d for d in hv.domains() if d.metadata.get("sandbox") == sandbox_id]
    finally:
        hv.close()
    return found.name, int(Path(f"/run/libvirt/qemu/{found.name}.pid").read_text())


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_cpu_quota_caps_a_spinning_guest(tmp_path: Path) -> None:
    svc = Service.make(tmp_path, KERNELHOST_VM_CPU_QUOTA_PERCENT="25", KERNELHOST_POOL_SIZE="0")
    svc.start()
    try:
        sbx = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        name, pid = _qemu_pid(svc, sbx.id)
        hv = svc.hypervisor()
        try:
            params = hv.conn.lookupByName(name).schedulerParameters()
        finally:
            hv.close()
        assert params["vcpu_period"] == 100_000 and params["vcpu_quota"] == 25_000, params
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        spun = await sbx.run_code(
            "import time\nt = time.time()\nwhile time.time() - t < 4:\n    pass", timeout=120
        )
        share = (_cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        assert spun.error is None, spun.error
        # the vCPU thread gets a quarter of a core; QEMU's own threads add a little
        assert share < 0.6, f"a spinning guest capped at 25% used {share:.0%} of a core"
        await sbx.close()
    finally:
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs


# -- memory, disk and processes ---------------------------------------------------------------------


async def test_allocation_bomb_ends_in_a_reported_kernel_death_then_a_working_sandbox(
    victim: AsyncSandbox, sandbox: AsyncSandbox
) -> None:
    await victim.run_code("before = 'set'")
    bomb = asyncio.ensure_future(
        victim.run_code("hoard = []\nwhile True:\n    hoard.append(bytearray(32 * 2**20))", timeout=300)
    )
    answered = await _while_other_answers(sandbox, bomb)
    died = bomb.result()
    assert died.status == "kernel_died", (died.status, died.error)
    assert died.error is not None and died.error.name in ("KernelDied", "SandboxLost")
    assert died.recovery in ("kernel_restarted", "vm_replaced")
    after = await victim.run_code("'before' in globals(), 6 * 7", timeout=120)
    assert after.text == "(False, 42)"
    assert answered >= 1


STANDBY_PROBE = """
import os
def _kh_probe():
    def field(path, name):
        for line in open(path):
            if line.startswith(name + ':'):
                return int(line.split()[1])
    for pid in (int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()):
        try:
            if b'launch_kernel.py' in open(f'/proc/{pid}/cmdline', 'rb').read():
                adj = int(open(f'/proc/{pid}/oom_score_adj').read())
                return pid, adj, field(f'/proc/{pid}/status', 'VmRSS'), field('/proc/meminfo', 'MemAvailable')
        except OSError:
            pass
_kh_probe()
"""


async def test_memory_a_cell_needs_is_taken_from_the_standby_kernel_first(victim: AsyncSandbox) -> None:
    """The standby kernel (what makes a restart fast) holds guest memory; a cell that needs more
    than is available gets it: the guest's OOM killer takes the standby, not the user's kernel,
    and a restart after that still works (the slow way)."""
    probe = await victim.run_code(STANDBY_PROBE, timeout=120)
    assert probe.status == "ok" and probe.text, probe
    pid, adj, rss_kib, available_kib = ast.literal_eval(probe.text)
    assert adj == 1000
    need = (available_kib + rss_kib // 2) << 10  # more than is available: only the standby has it
    run = await victim.run_code(
        f"kept = 1\nhoard = bytearray(b'\\x01') * {need}\nlen(hoard) == {need}", timeout=300
    )
    assert (run.status, run.text) == ("ok", "True"), (run.status, run.error)
    # killed: gone, or a zombie until the agent next looks at it (it holds no memory then)
    state = f"open('/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0]"
    gone = await victim.run_code(f"import os; os.path.exists('/proc/{pid}') and {state}, 'kept' in globals()")
    assert gone.text in ("(False, True)", "('Z', True)"), gone.text
    await victim.run_code("del hoard")
    await victim.restart()
    assert (await victim.run_code("'kept' in globals(), 6 * 7", timeout=120)).text == "(False, 42)"


async def test_full_disk_is_a_clear_error_in_the_guest_and_costs_the_host_nothing(
    service: Service, victim: AsyncSandbox
) -> None:
    host_before = _tree_bytes(service.state_dir) + _tree_bytes(service.run_dir)
    filled = await victim.run_code(
        "import os\n"
        "chunk = b'x' * 2**20\n"
        "with open('/home/user/fill', 'wb') as f:\n"
        "    while True:\n"
        "        f.write(chunk)\n"
        "        f.flush()\n",
        timeout=300,
    )
    assert filled.error is not None, filled
    assert filled.error.name == "OSError" and "No space left on device" in filled.error.value
    size = await victim.run_code("os.path.getsize('/home/user/fill') // 2**20")
    assert size.text is not None, size
    assert 64 <= int(size.text) <= 512, size.text  # the cap is half the VM's memory
    # the files API says the same, with its own code
    with pytest.raises(APIError) as full:
        await victim.files.write("/home/user/more", b"y" * (8 << 20))
    assert full.value.status == 507 and full.value.code == "sandbox_disk_full", full.value
    cleared = await victim.run_code(
        "os.remove('/home/user/fill')\nopen('/home/user/after', 'w').write('fits again')"
    )
    assert cleared.error is None, cleared.error
    assert (await victim.files.read("/home/user/after")) == b"fits again"
    grown = _tree_bytes(service.state_dir) + _tree_bytes(service.run_dir) - host_before
    assert grown < 16 << 20, f"the host's state and run directories grew by {grown} bytes"


async def test_fork_bomb_stays_inside_the_vm_and_the_timeout_recovers_it(
    victim: AsyncSandbox, sandbox: AsyncSandbox
) -> None:
    bomb = asyncio.ensure_future(
        victim.run_code("bomb() { bomb | bomb & }; bomb; sleep 600", language="bash", timeout=20)
    )
    answered = await _while_other_answers(sandbox, bomb)
    ended = bomb.result()
    assert ended.status == "timeout", (ended.status, ended.error)
    # pids.max keeps the bomb small enough for SIGINT to end it; the ladder's later rungs are
    # there for a guest without that cgroup
    assert ended.recovery in ("interrupted", "killed", "kernel_restarted", "vm_replaced"), ended.recovery
    # what it printed is the cap refusing forks; a loaded host's slow guest may not reach the
    # cap within the 20 s, or print nothing before it is stopped
    if ended.stderr.strip():
        assert "Resource temporarily unavailable" in ended.stderr, ended.stderr[-500:]
    after = await victim.run_code("echo alive; ps -e --no-headers | wc -l", language="bash", timeout=120)
    lines = after.stdout.split()
    assert lines[0] == "alive" and int(lines[1]) < 200, after.stdout
    assert answered >= 1


# -- a hostile guest on the channel -----------------------------------------------------------------

# Freeze the agent, take its end of the virtio port (pidfd_getfd; root in the guest may) and write
# what a broken or malicious agent would.
HIJACK = r"""
import ctypes, glob, os, signal
def _agent():
    for p in glob.glob('/proc/[0-9]*/cmdline'):
        try:
            argv = open(p, 'rb').read().split(b'\0')
        except OSError:
            continue
        if argv[0].endswith(b'python3') and b'kernelhost_agent' in argv:
            return int(p.split('/')[2])
pid = _agent()
port = next(int(n) for n in os.listdir(f'/proc/{pid}/fd')
            if os.readlink(f'/proc/{pid}/fd/{n}').startswith('/dev/vport'))
os.kill(pid, signal.SIGSTOP)
fd = ctypes.CDLL(None, use_errno=True).syscall(438, os.pidfd_open(pid), port, 0)
assert fd >= 0, ctypes.get_errno()
os.write(fd, PAYLOAD)
"""

PAYLOADS = {
    # a length prefix far over the frame limit: refused before a byte is buffered
    "oversize": "b'\\xff\\xff\\xff\\xf0' + b'x' * 4096",
    # a frame whose body is not msgpack at all
    "malformed": "(5).to_bytes(4, 'big') + b'\\xc1\\xc1\\xc1\\xc1\\xc1'",
    # valid msgpack, but not a map: the protocol says every frame is one
    "not_a_map": "(4).to_bytes(4, 'big') + b'\\x93\\x01\\x02\\x03'",
}


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
async def test_guest_sending_bad_frames_loses_its_vm_and_nobody_else_notices(
    service: Service, victim: AsyncSandbox, sandbox: AsyncSandbox, payload: str
) -> None:
    await victim.run_code("x = 1")
    hijacked = await victim.run_code(f"PAYLOAD = {PAYLOADS[payload]}\n{HIJACK}", timeout=120)
    assert hijacked.status == "kernel_died", (hijacked.status, hijacked.error)
    assert hijacked.error is not None and hijacked.error.name == "SandboxLost"
    assert "create a new sandbox" in hijacked.error.value
    assert (await sandbox.run_code("1 + 1")).text == "2"
    with pytest.raises(NotFoundError):  # a guest that broke the protocol is not trusted again
        await victim.info()
    hv = service.hypervisor()
    try:
        deadline = time.monotonic() + 30
        while [d for d in hv.domains() if d.metadata.get("sandbox") == victim.id]:
            assert time.monotonic() < deadline, "the hostile guest's VM was not destroyed"
            await asyncio.sleep(0.2)
    finally:
        hv.close()


async def test_guest_that_starts_a_frame_and_goes_silent_gets_a_new_vm(
    victim: AsyncSandbox, sandbox: AsyncSandbox
) -> None:
    """Half a frame, then nothing: the channel waits, the ladder's ping fails, the VM is replaced."""
    await victim.run_code("x = 1")
    payload = "(1000).to_bytes(4, 'big') + b'\\x81\\xa4type'"
    stalled = await victim.run_code(f"PAYLOAD = {payload}\n{HIJACK}\nimport time\ntime.sleep(600)", timeout=5)
    assert stalled.status == "timeout" and stalled.recovery == "vm_replaced", (
        stalled.status,
        stalled.recovery,
        stalled.error,
    )
    fresh = await victim.run_code("'x' in globals()", timeout=120)
    assert fresh.text == "False"
    assert (await sandbox.run_code("1 + 1")).text == "2"
