"""ipykernel's debugger in a kernelhost VM, driven over the Jupyter protocol the way JupyterLab's
debugger panel drives it (debug_request/debug_reply on control, debug_event on iopub), through
the kernelhost provisioner: a breakpoint in a cell stops it, a local variable is listed with its
value, a step moves to the next line, and continue lets the cell finish. And a debugger whose
client leaves while a cell is stopped at a breakpoint (through the Kernel Gateway WebSocket, as
JupyterLab's) lets the cell finish, so the sandbox's other callers are not held forever."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernelhost import AsyncSandbox

from ..harness import Service
from .jupyter_support import KernelSocket, ws_url

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

TIMEOUT = 120.0
CELL = "def add(a, b):\n    total = a + b\n    return total\n\nresult = add(2, 3)\nresult\n"


INITIALIZE = {
    "clientID": "kernelhost-test",
    "clientName": "kernelhost-test",
    "adapterID": "python",
    "pathFormat": "path",
    "linesStartAt1": True,
    "columnsStartAt1": True,
    "supportsVariableType": True,
    "supportsVariablePaging": True,
    "supportsRunInTerminalRequest": True,
    "locale": "en",
}


class Debugger:
    def __init__(self, kc: BlockingKernelClient) -> None:
        self.kc = kc
        self.seq = 0

    def request(self, command: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command, "arguments": arguments or {}}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            reply = self.kc.control_channel.get_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                assert reply["msg_type"] == "debug_reply", reply
                body: dict[str, Any] = reply["content"]
                return body
        raise AssertionError(f"no debug_reply to {command} within {TIMEOUT}s")

    def event(self, name: str) -> dict[str, Any]:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            msg = self.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["msg_type"] == "debug_event" and msg["content"].get("event") == name:
                content: dict[str, Any] = msg["content"]
                return content
        raise AssertionError(f"no debug_event {name!r} within {TIMEOUT}s")

    def locals_of(self, thread: int) -> dict[str, str]:
        frames = self.request("stackTrace", {"threadId": thread})["body"]["stackFrames"]
        scopes = self.request("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
        ref = next(s for s in scopes if s["name"] == "Locals")["variablesReference"]
        variables = self.request("variables", {"variablesReference": ref})["body"]["variables"]
        return {v["name"]: v["value"] for v in variables}


def test_a_breakpoint_in_a_cell_stops_it_and_shows_its_locals(vm_kernel: BlockingKernelClient) -> None:
    dbg = Debugger(vm_kernel)
    init = dbg.request("initialize", INITIALIZE)
    assert init["success"], init
    assert dbg.request("attach")["success"]
    source = dbg.request("dumpCell", {"code": CELL})["body"]["sourcePath"]
    placed = dbg.request(
        "setBreakpoints", {"breakpoints": [{"line": 2}], "source": {"path": source}, "sourceModified": False}
    )
    assert placed["success"] and placed["body"]["breakpoints"][0]["verified"], placed
    assert dbg.request("debugInfo")["body"]["isStarted"]
    assert dbg.request("configurationDone")["success"]

    msg_id = vm_kernel.execute(CELL)
    stopped = dbg.event("stopped")
    assert stopped["body"]["reason"] == "breakpoint", stopped
    thread = stopped["body"]["threadId"]
    local = dbg.locals_of(thread)
    assert (local["a"], local["b"]) == ("2", "3"), local

    assert dbg.request("next", {"threadId": thread})["success"]
    dbg.event("stopped")
    assert dbg.locals_of(thread)["total"] == "5"

    assert dbg.request("continue", {"threadId": thread})["success"]
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        reply = vm_kernel.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            assert reply["content"]["status"] == "ok", reply
            break
    else:
        raise AssertionError("the cell did not finish after continue")
    assert dbg.request("disconnect", {"restart": False, "terminateDebuggee": True})["success"]


async def _debug(
    kernel: KernelSocket, command: str, arguments: dict[str, Any] | None = None
) -> dict[str, Any]:
    content = {"type": "request", "seq": 1, "command": command, "arguments": arguments or {}}
    msg_id = await kernel.send("debug_request", content, channel="control")
    reply = await kernel.next(msg_id, TIMEOUT)
    while reply["header"]["msg_type"] != "debug_reply":
        reply = await kernel.next(msg_id, TIMEOUT)
    body: dict[str, Any] = reply["content"]
    assert body.get("success"), body
    return body


async def test_a_debugger_stopped_at_a_breakpoint_ends_when_its_client_leaves(
    jupyter_service: Service,
) -> None:
    svc = jupyter_service
    sbx = await AsyncSandbox.create(template="python", url=svc.url, api_key=svc.api_key)
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"token {svc.api_key}"}) as http:
            kernel = KernelSocket(await http.ws_connect(f"{ws_url(svc.url)}/api/kernels/{sbx.id}/channels"))
            try:
                await _debug(kernel, "initialize", INITIALIZE)
                await _debug(kernel, "attach")
                source = (await _debug(kernel, "dumpCell", {"code": CELL}))["body"]["sourcePath"]
                await _debug(
                    kernel, "setBreakpoints", {"breakpoints": [{"line": 2}], "source": {"path": source}}
                )
                await _debug(kernel, "configurationDone")
                await kernel.execute_request(CELL)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + TIMEOUT
                while not any(
                    m["header"]["msg_type"] == "debug_event" and m["content"].get("event") == "stopped"
                    for m in kernel.seen
                ):
                    assert loop.time() < deadline, "the cell did not stop at its breakpoint"
                    await asyncio.sleep(0.05)
            finally:
                await kernel.close()  # the client goes, its cell stopped at the breakpoint

        # the agent's call is not held behind the abandoned breakpoint: the debugger was
        # disconnected, the stopped cell ran to its end, and the call runs after it
        t0 = time.monotonic()
        execution = await asyncio.wait_for(sbx.run_code("result * 10"), TIMEOUT)
        waited = time.monotonic() - t0
        assert execution.error is None, execution.error
        assert execution.text == "50", execution
        assert waited < TIMEOUT
        # and the kernel's debugger can be attached again by a new client
        async with aiohttp.ClientSession(headers={"Authorization": f"token {svc.api_key}"}) as http:
            kernel = KernelSocket(await http.ws_connect(f"{ws_url(svc.url)}/api/kernels/{sbx.id}/channels"))
            try:
                await _debug(kernel, "initialize", INITIALIZE)
                await _debug(kernel, "attach")
                info = await _debug(kernel, "debugInfo")
                assert info["body"]["isStarted"] and info["body"]["breakpoints"] == [], info
                await _debug(kernel, "disconnect", {"restart": False, "terminateDebuggee": False})
            finally:
                await kernel.close()
    finally:
        await sbx.close()
