"""Faults from outside: QEMU killed under a sandbox, the service SIGKILLed mid-create."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import ConflictError

from ..harness import Service

pytestmark = pytest.mark.vm


async def test_qemu_killed_from_outside_is_reported_and_recoverable(
        service: Service, sandbox: AsyncSandbox) -> None:
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
        async with aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {svc.api_key}"}) as http:
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
