"""The OpenAI Agents SDK's own E2B sandbox client (``agents.extensions.sandbox.e2b``, unmodified)
against the service's E2B surface, through a real VM.

``Runner.run`` drives a ``SandboxAgent`` (the SDK's default capabilities: its shell tool is
``exec_command``) whose model is the SDK's scripted test model; ``RunConfig(sandbox=...)`` names
``E2BSandboxClient``, which creates the sandbox through E2B's SDK (configured, as its users do,
by ``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY``), runs each command in it, and kills
it when the run ends.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from agents import RunConfig, Runner, set_tracing_disabled
from agents.extensions.sandbox.e2b import E2BSandboxClient, E2BSandboxClientOptions
from agents.sandbox import SandboxAgent, SandboxRunConfig
from agents.testing import ModelCall, ModelStep, ScriptedModel, assistant_message, function_call

from kernelhost import AsyncSandbox

from ...harness import Service
from .conftest import outputs_seen_by

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

set_tracing_disabled(True)


def exec_command(cmd: str, call_id: str) -> Any:
    return function_call("exec_command", {"cmd": cmd}, call_id=call_id)


async def test_the_agents_sdk_e2b_client_runs_shell_commands_in_a_vm(e2b: Service) -> None:
    svc = e2b
    tag = uuid.uuid4().hex
    during: list[str] = []

    async def finish(call: ModelCall) -> Any:
        # the sandbox the client created, seen from kernelhost's side while the run holds it
        listed = await AsyncSandbox.list(url=svc.url, api_key=svc.api_key)
        during.extend(info.id for info in listed if info.metadata.get("run") == tag)
        return [assistant_message("f.txt says hi")]

    model = ScriptedModel(
        [
            [exec_command("echo hi > f.txt; cat f.txt; pwd", "call_1")],
            [exec_command("python3 -c \"print(open('f.txt').read().strip().upper() * 2)\"", "call_2")],
            ModelStep.respond(finish),
        ]
    )
    agent = SandboxAgent(name="shell", instructions="Use exec_command.", model=model)
    options = E2BSandboxClientOptions(sandbox_type="e2b", metadata={"run": tag})
    result = await Runner.run(
        agent,
        "Write hi to f.txt and shout it.",
        run_config=RunConfig(sandbox=SandboxRunConfig(client=E2BSandboxClient(), options=options)),
    )
    assert result.final_output == "f.txt says hi"
    model.assert_complete()
    assert any(tool.name == "exec_command" for tool in model.calls[0].tools)
    first = outputs_seen_by(model, 1)["call_1"]
    assert "Process exited with code 0" in first, first
    assert first.endswith("Output:\nhi\n/workspace\n"), first
    second = outputs_seen_by(model, 2)["call_2"]
    assert "Process exited with code 0" in second, second
    assert second.endswith("Output:\nHIHI\n"), second
    assert len(during) == 1, during
    # the run's end killed the sandbox
    remaining = await AsyncSandbox.list(url=svc.url, api_key=svc.api_key)
    assert during[0] not in {info.id for info in remaining}
