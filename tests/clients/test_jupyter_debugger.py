"""ipykernel's debugger in a kernelhost VM, driven over the Jupyter protocol the way JupyterLab's
debugger panel drives it (debug_request/debug_reply on control, debug_event on iopub), through
the kernelhost provisioner: a breakpoint in a cell stops it, a local variable is listed with its
value, a step moves to the next line, and continue lets the cell finish."""

from __future__ import annotations

import time
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

TIMEOUT = 120.0
CELL = "def add(a, b):\n    total = a + b\n    return total\n\nresult = add(2, 3)\nresult\n"


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
    init = dbg.request(
        "initialize",
        {
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
        },
    )
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
