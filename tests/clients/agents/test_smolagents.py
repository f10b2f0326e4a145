"""smolagents, unmodified, runs a ``CodeAgent``'s code in a real VM through its own E2B executor.

``CodeAgent(executor_type="e2b")`` makes smolagents' ``E2BExecutor``, which creates the sandbox
with ``e2b_code_interpreter.Sandbox.create()``: E2B's SDK configured, as its users do, by
``E2B_API_URL``, ``E2B_SANDBOX_URL`` and ``E2B_API_KEY`` (the ``e2b`` fixture). smolagents has no
model that works offline, so the model is a subclass of its ``Model`` that answers from a script
(code actions between ``<code>`` tags, as the default prompt asks). Step 1 defines a variable and
writes a file; step 2 uses both and calls ``final_answer``, which the executor turns into an
exception in the VM and reads back: the run's output is the value the VM computed. The sandbox
is the SDK's default template, ``code-interpreter-v1``: kernelhost's ``python-datasci``, which
has pillow, as E2B's has (the executor's ``final_answer`` imports ``PIL`` in the sandbox).
"""

from __future__ import annotations

from typing import Any

import pytest
from smolagents import CodeAgent
from smolagents.models import ChatMessage, MessageRole, Model
from smolagents.monitoring import TokenUsage

from kernelhost import Sandbox

from ...harness import Service

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

STEP_1 = "total = 40\nopen('/tmp/step1.txt', 'w').write('2')\nprint('stored', total)"
STEP_2 = "final_answer(total + int(open('/tmp/step1.txt').read()))"


class ScriptedModel(Model):  # type: ignore[misc]  # smolagents has no type information
    """A smolagents model that answers each call with the next code action of its script."""

    def __init__(self, actions: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.actions = list(actions)
        self.seen: list[str] = []  # the last message's text of each call: the observations

    def generate(
        self,
        messages: list[Any],
        stop_sequences: list[str] | None = None,
        response_format: dict[str, str] | None = None,
        tools_to_call_from: list[Any] | None = None,
        **kwargs: Any,
    ) -> ChatMessage:
        last = messages[-1]
        content = last.content if isinstance(last, ChatMessage) else last["content"]
        parts = content if isinstance(content, list) else [{"text": content}]
        self.seen.append("".join(str(part.get("text", "")) for part in parts))
        action = self.actions.pop(0)
        text = f"Thought: step {len(self.seen)}.\n<code>\n{action}\n</code>"
        return ChatMessage(role=MessageRole.ASSISTANT, content=text, token_usage=TokenUsage(1, 1))


def test_code_agent_runs_two_steps_in_one_e2b_sandbox(e2b: Service) -> None:
    model = ScriptedModel([STEP_1, STEP_2])
    agent = CodeAgent(
        tools=[],
        model=model,
        executor_type="e2b",
        # to Sandbox.create: a first python-datasci VM boots slowly where QEMU falls back to TCG
        executor_kwargs={"request_timeout": 500},
        max_steps=4,
        verbosity_level=0,
    )
    try:
        sandbox_id = agent.python_executor.sandbox.sandbox_id
        listed = Sandbox.list(url=e2b.url, api_key=e2b.api_key)
        assert sandbox_id in {info.id for info in listed}  # a kernelhost VM
        answer = agent.run("Store 40 and 2 in the sandbox, then add them up.")
    finally:
        agent.cleanup()  # kills the sandbox through E2B's SDK
    assert answer == 42  # the value the VM computed, deserialized by the executor
    assert not model.actions, "the agent stopped before the script's end"
    assert "Execution logs:\nstored 40\n" in model.seen[1], model.seen[1]  # step 1's output, from the VM
    remaining = Sandbox.list(url=e2b.url, api_key=e2b.api_key)
    assert sandbox_id not in {info.id for info in remaining}
