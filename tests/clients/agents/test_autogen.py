"""AutoGen (``autogen-agentchat`` and ``autogen-ext``, unmodified) runs an agent's code through
kernelhost's Kernel Gateway API, in a real VM.

AutoGen's Jupyter-server executor, ``DockerJupyterCodeExecutor``, takes any Jupyter server's
``JupyterConnectionInfo``: here the service's host, port and key. It checks ``GET
/api/kernelspecs`` for ``python3``, starts it with ``POST /api/kernels``, runs each code block over
the kernel's channels WebSocket and deletes the kernel at the end. ``autogen-core`` pins
``protobuf~=5.29``, so AutoGen runs in a virtualenv of its own (isolated.py) with
``drive_autogen.py``. The model is AutoGen's ``ReplayChatCompletionClient``: step 1 defines a
variable and writes a file, step 2 uses both, then the model answers.
"""

from __future__ import annotations

import pytest

from kernelhost import Sandbox

from ...harness import Service
from .isolated import AUTOGEN, framework_python, run_driver

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]


def test_assistant_agent_runs_two_steps_in_one_gateway_kernel(agents_service: Service) -> None:
    python = framework_python("autogen", AUTOGEN)
    before = {info.id for info in Sandbox.list(url=agents_service.url, api_key=agents_service.api_key)}
    seen = run_driver(python, "drive_autogen.py", agents_service)
    [[first], [second]] = seen["outputs"]
    assert first == {"content": "stored\n", "is_error": False}, first
    assert second == {"content": "42", "is_error": False}, second  # computed in the VM
    # the model's last request carried the VM's answer back to it
    assert any("content='42'" in message for message in seen["last_request"]), seen["last_request"]
    assert seen["calls"] == 3 and seen["final"] == "done"
    # the executor's stop deleted its kernel, and with it the sandbox the gateway had started
    after = {info.id for info in Sandbox.list(url=agents_service.url, api_key=agents_service.api_key)}
    assert after <= before, after - before
