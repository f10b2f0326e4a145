"""prepare_snapshot (warm-up before a template is frozen) and resumed (after a restore)."""

from __future__ import annotations

import copy
import random
import time

import pytest
from kernelhost_agent import kernel as kernel_module

from kernelhost.channel import protocol

from .conftest import Running
from .host import HostEnd

pytestmark = pytest.mark.unit


async def test_prepare_snapshot_preloads_and_leaves_no_trace(host: HostEnd) -> None:
    reply = await host.ok(protocol.Op.PREPARE_SNAPSHOT, preload=["json", "xml.dom", 7, ""], timeout=60.0)
    assert reply["preloaded"] == ["json", "xml.dom"]  # what is not a name is skipped
    assert reply["seconds"] >= 0
    run = await host.execute(
        "import sys\n"
        "print('json' in sys.modules, 'xml.dom' in sys.modules, hasattr(sys, 'last_value'),"
        " [k for k in globals() if k[:1] == '_' and k[1:].isdigit()])"
    )
    assert run.stream() == "True True False []\n"
    # the warm-up cells stored no history: the first cell of a user is still number 1
    assert run.reply["content"]["execution_count"] == 1


async def test_prepare_snapshot_refuses_what_is_not_a_module_name(host: HostEnd) -> None:
    error = await host.refused(protocol.Op.PREPARE_SNAPSHOT, preload=["os; import sys"])
    assert error.startswith("ValueError: not a module name")
    error = await host.refused(protocol.Op.PREPARE_SNAPSHOT, preload="json")
    assert "preload must be a list" in error


async def test_resumed_reseeds_the_kernels_random(host: HostEnd) -> None:
    await host.execute("import random; random.seed(1234)")
    before = time.time()
    reply = await host.ok(protocol.Op.RESUMED, time_ns=1, entropy=b"\x01" * 600)
    assert reply["seconds"] >= 0
    assert time.time() >= before  # clock setting is off in this config: time did not go to 1970
    run = await host.execute("print(random.random())")
    assert float(run.stream()) != random.Random(1234).random()


async def test_the_reseed_is_a_control_message_not_a_cell(host: HostEnd) -> None:
    """kernel_reseed.py: the kernel answers ``kernelhost_reseed_request`` on control with new
    seeds, and no cell ran (IPython's counter did not move)."""
    count = "print(get_ipython().execution_count)"
    before = int((await host.execute("import random; random.seed(99)\n" + count)).stream())
    msg = host.jupyter_msg("kernelhost_reseed_request", {})
    await host.send_jupyter("control", msg)
    while True:
        channel, reply = await host.next_message(msg["header"]["msg_id"])
        if channel == "control":
            break
    assert reply["header"]["msg_type"] == "kernelhost_reseed_reply"
    assert reply["content"] == {"status": "ok"}
    after = await host.execute("print(random.random())\n" + count)
    drawn, shown = after.stream().split()
    assert float(drawn) != random.Random(99).random()
    assert int(shown) == before + 1


async def test_a_kernel_that_ignores_the_reseed_request_gets_the_cell(
    host: HostEnd, running: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel not launched by launch_kernel.py never answers the control message: after
    ``RESEED_REQUEST_TIMEOUT`` the reseed cell runs instead."""
    kernel = running.agent.kernel
    language = copy.copy(kernel.language)
    language.reseed_request = "kernelhost_no_such_request"
    monkeypatch.setattr(kernel, "language", language)
    monkeypatch.setattr(kernel_module, "RESEED_REQUEST_TIMEOUT", 0.5)
    await host.execute("import random; random.seed(7)")
    await host.ok(protocol.Op.RESUMED, time_ns=1, entropy=b"\x02" * 32)
    run = await host.execute("print(random.random())")
    assert float(run.stream()) != random.Random(7).random()


async def test_resumed_ignores_fields_of_the_wrong_type(host: HostEnd) -> None:
    await host.ok(protocol.Op.RESUMED, time_ns="soon", entropy="not bytes")
    await host.ok(protocol.Op.RESUMED, time_ns=True, entropy=b"")


async def test_warm_up_output_never_reaches_the_host(host: HostEnd) -> None:
    assert host.strays() == []


async def test_warm_up_runs_the_first_cells_and_leaves_no_trace(host: HostEnd) -> None:
    """A pooled clone's warm-up (the ops run before a user has the sandbox): afterwards the
    execution count is where it was, and no result, output or error of it is left."""
    code = (
        "import sys\n"
        "print(get_ipython().execution_count, hasattr(sys, 'last_value'),"
        " sorted(k for k in globals() if k[:1] == '_' and k[1:].isdigit()))"
    )
    before = await host.execute(code)
    count = before.reply["content"]["execution_count"]
    shown = int(before.stream().split()[0])  # IPython's counter, which runs one ahead in a cell
    reply = await host.ok(protocol.Op.WARM_UP, timeout=60.0)
    assert reply["seconds"] >= 0
    after = await host.execute(code)
    assert after.stream() == f"{shown + 1} False []\n"
    assert after.reply["content"]["execution_count"] == count + 1
    assert host.strays() == []
