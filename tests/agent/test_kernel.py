"""The relay and the ops every agent has, against a real ipykernel."""

from __future__ import annotations

import asyncio

import pytest

from kernelhost.channel import protocol

from .conftest import Running
from .host import WAIT, HostEnd

pytestmark = pytest.mark.unit


async def test_hello_announces_version_and_capabilities(host: HostEnd) -> None:
    reply = await host.ok(protocol.Op.HELLO)
    assert reply["agent_version"] == protocol.AGENT_PROTOCOL
    assert reply["capabilities"] == sorted(c.value for c in protocol.Capability)
    assert reply["kernel_info"]["language_info"]["name"] == "python"
    assert isinstance(reply["boot_id"], str) and len(reply["boot_id"]) == 32


async def test_ping(host: HostEnd) -> None:
    reply = await host.ok(protocol.Op.PING)
    assert reply["ready"] is True and reply["kernel_alive"] is True


async def test_execute_is_relayed_both_ways(host: HostEnd) -> None:
    run = await host.execute("x = 40 + 2\nprint('hi')\nx")
    assert run.stream() == "hi\n"
    [result] = run.of_type("execute_result")
    assert result["content"]["data"]["text/plain"] == "42"
    assert run.reply["header"]["msg_type"] == "execute_reply"
    assert run.reply["content"]["status"] == "ok"
    assert run.reply["parent_header"]["msg_id"] == run.msg_id
    # the usage figures of the execution ride on the reply's metadata
    usage = run.reply["metadata"]["kernelhost"]
    assert usage["cpu_ms"] >= 0 and usage["peak_memory_bytes"] > 0


async def test_usage_figures_measure_the_execution(host: HostEnd) -> None:
    run = await host.execute("sum(range(3 * 10**6)); big = bytearray(64 * 2**20); del big")
    usage = run.reply["metadata"]["kernelhost"]
    assert usage["cpu_ms"] > 0
    assert usage["peak_memory_bytes"] > 64 * 2**20


async def test_output_is_capped_per_execution(host: HostEnd) -> None:
    limits = {"kernelhost": {"max_output_bytes": 10}}
    run = await host.execute("print('x' * 1000)\nfor _ in range(50): print('abcdef')", metadata=limits)
    assert run.stream() == "x" * 11  # the cap and one more byte: the host sees the cut
    assert run.reply["content"]["status"] == "ok"
    # the next execution without a cap is not cut
    assert (await host.execute("print('y' * 100)")).stream() == "y" * 100 + "\n"


async def test_the_cap_counts_utf8_bytes_on_the_agent(host: HostEnd, running: Running) -> None:
    """The kernel cuts characters; the agent's own cut (for kernels without kernel_limits)
    counts bytes and never splits a character."""
    meter = running.agent.relay.meter
    msg = host.jupyter_msg("execute_request", {"code": ""}, {"kernelhost": {"max_output_bytes": 4}})
    meter.note_execute_request("shell", msg)
    msg_id = msg["header"]["msg_id"]
    stream = {
        "header": {"msg_type": "stream"},
        "parent_header": {"msg_id": msg_id},
        "metadata": {},
        "content": {"name": "stdout", "text": "ééé"},
    }
    assert meter.cap_and_measure("iopub", stream) is True
    assert stream["content"]["text"] == "éé"  # 5 bytes allowed, the third é would need 6
    assert meter.cap_and_measure("iopub", {**stream, "content": {"text": "more"}}) is False


async def test_stdin_is_relayed(host: HostEnd) -> None:
    msg = host.jupyter_msg(
        "execute_request",
        {
            "code": "name = input('who? ')\nprint('hello', name)",
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": True,
            "stop_on_error": True,
        },
    )
    await host.send_jupyter("shell", msg)
    msg_id = msg["header"]["msg_id"]
    while True:
        channel, prompt = await host.next_message(msg_id)
        if channel == "stdin":
            break
    assert prompt["header"]["msg_type"] == "input_request"
    assert prompt["content"]["prompt"] == "who? "
    answer = host.jupyter_msg("input_reply", {"value": "kernelhost"})
    answer["parent_header"] = prompt["header"]
    await host.send_jupyter("stdin", answer)
    run = await host.collect(msg_id)
    assert run.stream() == "hello kernelhost\n"


async def test_control_channel(host: HostEnd) -> None:
    msg = host.jupyter_msg("kernel_info_request", {})
    await host.send_jupyter("control", msg)
    while True:
        channel, reply = await host.next_message(msg["header"]["msg_id"])
        if channel == "control":
            break
    assert reply["header"]["msg_type"] == "kernel_info_reply"


async def test_interrupt_stops_a_running_cell(host: HostEnd) -> None:
    msg_id = await host.start("import time\nprint('looping', flush=True)\nwhile True:\n    time.sleep(0.05)")
    while True:  # the loop runs once its output is out
        _, out = await host.next_message(msg_id)
        if out["header"]["msg_type"] == "stream":
            break
    await host.ok(protocol.Op.INTERRUPT)
    run = await host.collect(msg_id)
    assert run.reply["content"]["status"] == "error"
    assert run.reply["content"]["ename"] == "KeyboardInterrupt"


STALL = """\
import time
def _stall(lines):
    if lines and lines[0].startswith('# stall'):
        time.sleep(30)
    return lines
get_ipython().input_transformers_cleanup.append(_stall)
"""


async def test_an_interrupt_before_the_cells_code_runs_still_gets_a_reply(host: HostEnd) -> None:
    """SIGINT while the kernel prepares a cell (after execute_input, in an input transformer):
    ipykernel alone swallows that KeyboardInterrupt and never replies (kernel_interrupt.py)."""
    assert (await host.execute(STALL)).reply["content"]["status"] == "ok"
    try:
        msg_id = await host.start("# stall\nran = True")
        while (await host.next_message(msg_id))[1]["header"]["msg_type"] != "execute_input":
            pass
        await asyncio.sleep(0.5)  # in the transformer's sleep by now
        await host.ok(protocol.Op.INTERRUPT)
        run = await host.collect(msg_id)
        assert run.reply["content"]["status"] == "error"
        assert run.reply["content"]["ename"] == "KeyboardInterrupt"
        errors = [m for m in run.iopub if m["header"]["msg_type"] == "error"]
        assert [m["content"]["ename"] for m in errors] == ["KeyboardInterrupt"]
    finally:
        await host.execute("get_ipython().input_transformers_cleanup.remove(_stall)")
    after = await host.execute("'ran' in dir()")
    assert after.reply["content"]["status"] == "ok"
    results = [m for m in after.iopub if m["header"]["msg_type"] == "execute_result"]
    assert results[0]["content"]["data"]["text/plain"] == "False"  # the cell never ran


async def test_a_message_msgpack_cannot_carry_is_dropped_not_fatal(host: HostEnd) -> None:
    """User code decides what the kernel sends: an integer over 64 bits in a display's
    metadata cannot be encoded, and the relay must go on with the next message."""
    run = await host.execute(
        "from IPython.display import publish_display_data\n"
        "publish_display_data({'text/plain': 'big'}, metadata={'n': 10**30})\n"
        "print('after')"
    )
    assert run.stream() == "after\n"
    assert not run.of_type("display_data")
    assert (await host.execute("1 + 1")).of_type("execute_result")


async def test_restart_gives_a_fresh_namespace(host: HostEnd) -> None:
    await host.execute("kept = 1")
    reply = await host.ok(protocol.Op.RESTART, timeout=3 * WAIT)
    assert reply["kernel_info"]["language_info"]["name"] == "python"
    event = await asyncio.wait_for(host.events.get(), WAIT)
    assert event == {"op": "event", "event": "kernel_restarted", "reason": "requested"}
    run = await host.execute("'kept' in globals()")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "False"


async def test_a_dead_kernel_is_reported_and_replaced(host: HostEnd) -> None:
    msg = host.jupyter_msg(
        "execute_request",
        {
            "code": "import os; os._exit(3)",
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
    )
    await host.send_jupyter("shell", msg)
    died = await asyncio.wait_for(host.events.get(), WAIT)
    assert died == {"op": "event", "event": "kernel_died", "exit_code": 3}
    restarted = await asyncio.wait_for(host.events.get(), 3 * WAIT)
    assert restarted["event"] == "kernel_restarted" and restarted["reason"] == "died"
    run = await host.execute("6 * 7")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"
    assert (await host.ok(protocol.Op.PING))["kernel_alive"] is True


async def test_the_agents_own_requests_never_reach_the_host(host: HostEnd) -> None:
    """kernel_info at start and after each restart is the agent's: none of its replies, and
    none of the iopub status messages that follow them, are relayed."""
    assert host.strays() == []


async def test_requests_during_a_restart(host: HostEnd) -> None:
    """A ping is answered at once, hello and shell messages wait for the new kernel."""
    await host.execute("kept = 1")
    restart = asyncio.ensure_future(host.ok(protocol.Op.RESTART, timeout=3 * WAIT))
    ping = await host.ok(protocol.Op.PING)
    assert ping["kernel_alive"] in (True, False)  # whichever kernel it found
    hello = asyncio.ensure_future(host.ok(protocol.Op.HELLO, timeout=3 * WAIT))
    run = await host.execute("'fresh' if 'kept' not in globals() else 'old'", timeout=3 * WAIT)
    await restart
    assert (await hello)["agent_version"] == protocol.AGENT_PROTOCOL
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "'fresh'"
    event = await asyncio.wait_for(host.events.get(), WAIT)
    assert event["event"] == "kernel_restarted"
