"""Comm messages (what widgets are made of) both ways between a Jupyter client and a kernel in
a kernelhost VM, through the provisioner: a comm the client opens reaches a target the kernel
registered and is answered, and a comm the kernel opens reaches the client and hears from it."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

TIMEOUT = 120.0
TARGET = """
seen = []
def _echo(comm, open_msg):
    seen.append(open_msg["content"]["data"])
    @comm.on_msg
    def _got(msg):
        seen.append(msg["content"]["data"])
        comm.send({"echo": msg["content"]["data"]["value"] * 2})
get_ipython().kernel.comm_manager.register_target("kh-echo", _echo)
"""


def _iopub(kc: BlockingKernelClient, msg_type: str, comm_id: str | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == msg_type and (comm_id is None or msg["content"].get("comm_id") == comm_id):
            content: dict[str, Any] = msg["content"]
            return content
    raise AssertionError(f"no {msg_type} within {TIMEOUT}s")


def _run(kc: BlockingKernelClient, code: str) -> dict[str, Any]:
    reply: dict[str, Any] = kc.execute_interactive(code, timeout=TIMEOUT, output_hook=lambda m: None)
    assert reply["content"]["status"] == "ok", reply["content"]
    return reply


def test_comms_go_both_ways(vm_kernel: BlockingKernelClient) -> None:
    _run(vm_kernel, TARGET)
    comm_id = uuid.uuid4().hex
    vm_kernel.shell_channel.send(
        vm_kernel.session.msg(
            "comm_open", {"comm_id": comm_id, "target_name": "kh-echo", "data": {"hello": 1}}
        )
    )
    vm_kernel.shell_channel.send(
        vm_kernel.session.msg("comm_msg", {"comm_id": comm_id, "data": {"value": 21}})
    )
    assert _iopub(vm_kernel, "comm_msg", comm_id)["data"] == {"echo": 42}
    assert _printed(vm_kernel, "print(seen)").strip() == "[{'hello': 1}, {'value': 21}]"

    # the kernel opens one; the client answers on it; the kernel hears it
    opens: list[dict[str, Any]] = []  # the cell's iopub messages: its comm_open is among them
    reply = vm_kernel.execute_interactive(
        "from ipykernel.comm import Comm\n"
        "heard = []\n"
        "c = Comm(target_name='kh-client', data={'from': 'kernel'})\n"
        "c.on_msg(lambda m: heard.append(m['content']['data']))",
        timeout=TIMEOUT,
        output_hook=lambda m: opens.append(m["content"]) if m["msg_type"] == "comm_open" else None,
    )
    assert reply["content"]["status"] == "ok", reply["content"]
    (opened,) = opens
    assert opened["target_name"] == "kh-client" and opened["data"] == {"from": "kernel"}
    vm_kernel.shell_channel.send(
        vm_kernel.session.msg("comm_msg", {"comm_id": opened["comm_id"], "data": {"x": 7}})
    )
    deadline = time.monotonic() + TIMEOUT
    printed = ""
    while time.monotonic() < deadline:
        printed = _printed(vm_kernel, "print(heard)")
        if printed.strip() == "[{'x': 7}]":
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the kernel did not hear the client's comm_msg: {printed!r}")


def _printed(kc: BlockingKernelClient, code: str) -> str:
    out: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            out.append(msg["content"].get("text", ""))

    kc.execute_interactive(code, timeout=TIMEOUT, output_hook=hook)
    return "".join(out)
