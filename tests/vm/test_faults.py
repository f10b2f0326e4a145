"""Faults from outside: QEMU killed under a sandbox, libvirtd restarted under live ones, the
service SIGKILLed mid-create and mid-fork."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import ConflictError

from ..harness import Service

pytestmark = pytest.mark.vm


async def test_qemu_killed_from_outside_is_reported_and_recoverable(
    service: Service, sandbox: AsyncSandbox
) -> None:
    victim = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    hv = service.hypervisor()
    try:
        await victim.run_code("doomed = True")
        deadline = time.monotonic() + 30
        while not (found := [d for d in hv.domains() if d.metadata.get("sandbox") == victim.id]):
            assert time.monotonic() < deadline, "the sandbox's domain never got its label"
            await asyncio.sleep(0.1)
        pid = int(Path(f"/run/libvirt/qemu/{found[0].name}.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while (await victim.info()).state != "dead":
            assert time.monotonic() < deadline, "the service never noticed the VM died"
            await asyncio.sleep(0.1)
        with pytest.raises(ConflictError) as err:
            await victim.run_code("doomed")
        assert victim.id in str(err.value) and "restart" in str(err.value)
        # other sandboxes never notice
        assert (await sandbox.run_code("1 + 1")).text == "2"
        # restart gives it a fresh VM; its state is gone, as the error said
        await victim.restart()
        fresh = await victim.run_code("'doomed' in globals()")
        assert fresh.text == "False"
    finally:
        await victim.close()
        hv.close()


async def test_service_killed_mid_create_leaks_nothing(tmp_path: Path) -> None:
    # snapshots off: a create is a ~12 s cold boot, a wide window to kill the service in
    svc = Service.make(tmp_path, KERNELHOST_SNAPSHOTS="off", KERNELHOST_POOL_SIZE="0")
    svc.start()
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
            create = asyncio.create_task(http.post(f"{svc.url}/v1/sandboxes", json={}))
            hv = svc.hypervisor()
            try:
                deadline = time.monotonic() + 30
                while not hv.domains():  # the VM is booting: kill the service now
                    assert time.monotonic() < deadline, "no domain appeared"
                    await asyncio.sleep(0.05)
                assert svc.proc is not None
                svc.proc.send_signal(signal.SIGKILL)
                svc.proc.wait(10)
                with pytest.raises(aiohttp.ClientError):
                    await asyncio.wait_for(create, 30)
                assert hv.domains(), "the half-made VM should still be there before a restart"
                svc.start()
                assert hv.domains() == []
                assert not list(svc.run_dir.glob(svc.prefix + "*"))
                r = await http.get(f"{svc.url}/v1/sandboxes")
                assert (await r.json()) == {"sandboxes": []}
            finally:
                hv.close()
    finally:
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs


REPO = Path(__file__).resolve().parents[2]


def _restart_libvirt_daemons() -> None:
    """Stop libvirtd and virtlogd the way an operator or a crash would; start them again."""
    for pidfile in ("/run/libvirtd.pid", "/run/virtlogd.pid"):
        pid = int(Path(pidfile).read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, f"{pidfile} did not stop"
            time.sleep(0.1)
    subprocess.run(["bash", str(REPO / "scripts" / "start-libvirt.sh")], check=True, timeout=60)


async def test_libvirt_daemons_restarted_under_live_sandboxes_lose_nothing(
    service: Service, sandbox: AsyncSandbox
) -> None:
    survivor = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    kids: list[AsyncSandbox] = []
    try:
        await survivor.run_code("kept = {'n': 7}")
        await asyncio.to_thread(_restart_libvirt_daemons)
        # running VMs never depended on libvirtd: their channels go straight to QEMU
        assert (await survivor.run_code("kept['n']")).text == "7"
        # and everything that needs libvirt works again: fork, create, delete
        kids = await survivor.fork(1)
        assert (await kids[0].run_code("kept['n'] * 6")).text == "42"
        extra = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
        assert (await extra.run_code("1 + 1")).text == "2"
        await extra.close()
        assert (await sandbox.run_code("1 + 1")).text == "2"
    finally:
        for kid in kids:
            await kid.close()
        await survivor.close()
    hv = service.hypervisor()
    try:
        mine = {survivor.id, *(k.id for k in kids)}
        assert not [d for d in hv.domains() if d.metadata.get("sandbox") in mine]
    finally:
        hv.close()


async def test_service_killed_mid_fork_leaks_nothing(tmp_path: Path) -> None:
    svc = Service.make(tmp_path, KERNELHOST_POOL_SIZE="0")
    svc.start()
    try:
        parent = await AsyncSandbox.create(url=svc.url, api_key=svc.api_key)
        await parent.run_code("data = list(range(10**6))")
        hv = svc.hypervisor()
        try:
            before = {d.name for d in hv.domains()}
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
                fork = asyncio.create_task(
                    http.post(f"{svc.url}/v1/sandboxes/{parent.id}/fork", json={"n": 3})
                )
                deadline = time.monotonic() + 60
                while not ({d.name for d in hv.domains()} - before):  # children appearing
                    assert time.monotonic() < deadline, "no child domain appeared"
                    await asyncio.sleep(0.02)
                assert svc.proc is not None
                svc.proc.send_signal(signal.SIGKILL)
                svc.proc.wait(10)
                with pytest.raises(aiohttp.ClientError):
                    await asyncio.wait_for(fork, 30)
            svc.start()
            # the parent was live before the kill: it is reattached with its state; the
            # half-made children are gone, domains and files alike
            assert (await parent.run_code("len(data)")).text == "1000000"
            assert {d.name for d in hv.domains()} == before
            left = {p.name for p in svc.run_dir.glob(svc.prefix + "*")}
            assert left <= before, left - before
            listed = [s.id for s in await AsyncSandbox.list(url=svc.url, api_key=svc.api_key)]
            assert listed == [parent.id]
            await parent.close()
        finally:
            hv.close()
    finally:
        leaked, leaked_dirs = svc.cleanup()
        assert not leaked and not leaked_dirs
