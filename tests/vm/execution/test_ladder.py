"""The timeout ladder, kernel and VM death, interrupt and restart, through real VMs: a call
that runs too long, a kernel that ignores SIGINT or dies, a frozen agent, a killed VM."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from kernelhost import AsyncSandbox
from kernelhost.client import NotFoundError

from ...harness import Service
from .common import AGENT_TIMEOUT, GRACE, alive

pytestmark = pytest.mark.vm


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(1000)"])
async def test_timeout_interrupts_and_keeps_state(py: AsyncSandbox, code: str) -> None:
    await py.run_code("kept = 'yes'")
    t0 = time.monotonic()
    execution = await py.run_code(code, timeout=2)
    took = time.monotonic() - t0
    assert execution.status == "timeout" and execution.recovery == "interrupted"
    assert execution.error is not None and execution.error.name == "TimeoutError"
    assert "KeyboardInterrupt" in execution.error.value and execution.error.traceback
    assert took < 2 + GRACE + 10
    assert (await py.run_code("kept")).text == "'yes'"


async def test_long_numpy_computation_ends_at_the_timeout(ds: AsyncSandbox) -> None:
    """BLAS does not look at signals: the interrupt waits, so the kernel is restarted."""
    await ds.run_code("import numpy as np\nbefore = 1")
    t0 = time.monotonic()
    execution = await ds.run_code("a = np.random.rand(3000, 3000)\nb = a @ a @ a @ a", timeout=3)
    took = time.monotonic() - t0
    assert execution.status == "timeout"
    assert execution.recovery in ("interrupted", "kernel_restarted"), execution.error
    assert took < 3 + GRACE + AGENT_TIMEOUT + 60
    after = await ds.run_code("import numpy as np\nint(np.arange(4).sum())", timeout=120)
    assert after.text == "6"


async def test_kernel_ignoring_sigint_is_restarted(py: AsyncSandbox) -> None:
    await py.run_code("doomed = 1")
    execution = await py.run_code(
        "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", timeout=2
    )
    assert execution.status == "timeout" and execution.recovery == "kernel_restarted"
    assert execution.error is not None and "restarted" in execution.error.value
    gone = await py.run_code("doomed")
    assert gone.error is not None and gone.error.name == "NameError"
    await alive(py)


async def test_frozen_agent_gets_the_sandbox_a_new_vm(fresh: AsyncSandbox) -> None:
    await fresh.files.write("/tmp/before.txt", b"x")
    t0 = time.monotonic()
    execution = await fresh.run_code(
        "import os, signal\nos.kill(os.getppid(), signal.SIGSTOP)\nwhile True:\n    pass", timeout=2
    )
    assert execution.status == "timeout" and execution.recovery == "vm_replaced", execution.error
    assert execution.error is not None and "fresh VM" in execution.error.value
    assert time.monotonic() - t0 < 2 + GRACE + AGENT_TIMEOUT + 90
    await alive(fresh)
    with pytest.raises(NotFoundError):
        await fresh.files.read("/tmp/before.txt")  # a new VM: files are gone too
    assert (await fresh.info()).state == "running"


async def test_bash_timeout_interrupts_then_kills(py: AsyncSandbox) -> None:
    interrupted = await py.run_code("sleep 1000", language="bash", timeout=2)
    assert interrupted.status == "timeout" and interrupted.recovery == "interrupted"
    stubborn = await py.run_code("trap '' INT; while :; do :; done", language="bash", timeout=2)
    assert stubborn.status == "timeout" and stubborn.recovery == "killed"
    assert stubborn.error is not None and "killed" in stubborn.error.value
    assert (await py.run_code("echo fine", language="bash", timeout=30)).stdout == "fine\n"


# -- kernel and VM death --------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["import os\nos._exit(1)", "import ctypes\nctypes.string_at(0)"])
async def test_dead_kernel_is_reported_and_next_call_gets_a_fresh_one(fresh: AsyncSandbox, code: str) -> None:
    # a sandbox of its own: on ``py``, the kernel a test before restarted may still be starting
    # its standby, and how long the restart then takes would depend on that test's timing
    await fresh.run_code("lost = 1")
    died = await fresh.run_code(code, timeout=60)
    assert died.status == "kernel_died" and died.recovery == "kernel_restarted"
    assert died.error is not None and died.error.name == "KernelDied"
    after = await fresh.run_code("'lost' in globals()", timeout=120)
    assert after.text == "False"


async def test_vm_that_dies_is_replaced(fresh: AsyncSandbox) -> None:
    """Killing the guest agent makes the guest panic and libvirt destroy the VM."""
    execution = await fresh.run_code("import os\nos.kill(os.getppid(), 9)", timeout=60)
    assert execution.status == "kernel_died" and execution.recovery == "vm_replaced"
    assert execution.error is not None and execution.error.name == "SandboxLost"
    await alive(fresh)


# -- interrupt and restart ------------------------------------------------------------------------


async def test_interrupt_and_restart_do_not_wait_for_the_running_call(py: AsyncSandbox) -> None:
    await py.run_code("survivor = 'here'")
    running = asyncio.create_task(py.run_code("import time\nfor i in range(1000):\n    time.sleep(1)"))
    await asyncio.sleep(2)
    assert await py.interrupt() is True
    stopped = await asyncio.wait_for(running, 30)
    assert stopped.status == "interrupted"
    assert stopped.error is not None and stopped.error.name == "KeyboardInterrupt"
    assert (await py.run_code("survivor")).text == "'here'"

    running = asyncio.create_task(py.run_code("import time\ntime.sleep(1000)"))
    await asyncio.sleep(2)
    assert await py.restart() == "kernel_restarted"
    ended = await asyncio.wait_for(running, 30)
    assert ended.status == "restarted"
    gone = await py.run_code("survivor")
    assert gone.error is not None and gone.error.name == "NameError"
    assert await py.interrupt() is False  # nothing runs


async def test_interrupt_reaches_a_bash_command(py: AsyncSandbox) -> None:
    running = asyncio.create_task(py.run_code("echo go; sleep 1000", language="bash"))
    await asyncio.sleep(2)
    assert await py.interrupt() is True
    stopped = await asyncio.wait_for(running, 30)
    assert stopped.status == "interrupted" and stopped.exit_code == 130
    assert stopped.stdout == "go\n"


async def test_client_disconnect_interrupts_the_call(fresh: AsyncSandbox, execution_service: Service) -> None:
    # a sandbox of its own: right after another test's restart, the shared one's vCPU also starts
    # its next standby kernel, and the interrupt could miss this service's 3 s grace
    py = fresh
    await py.run_code("still = 'there'")
    auth = {"Authorization": f"Bearer {execution_service.api_key}"}
    async with aiohttp.ClientSession(headers=auth) as http:
        resp = await http.post(
            f"{execution_service.url}/v1/sandboxes/{py.id}/execute",
            json={"code": "print('spinning', flush=True)\nwhile True:\n    pass"},
        )
        assert (await asyncio.wait_for(resp.content.readline(), 30)).startswith(b'{"type":"stdout"')
        resp.close()  # hang up mid-call, no timeout given
    t0 = time.monotonic()
    after = await py.run_code("still", timeout=60)  # would queue forever behind the spin
    assert after.text == "'there'" and time.monotonic() - t0 < 30
