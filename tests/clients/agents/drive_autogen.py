"""Driver of test_autogen.py, run with the AutoGen virtualenv's Python (isolated.py): AutoGen's
``AssistantAgent`` with its ``PythonCodeExecutionTool`` on a ``DockerJupyterCodeExecutor`` given
kernelhost's Kernel Gateway API as its Jupyter server (``JupyterConnectionInfo``: host, port,
token), and AutoGen's scripted model ``ReplayChatCompletionClient``. Prints one JSON line."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any
from urllib.parse import urlsplit

from autogen_agentchat.agents import AssistantAgent
from autogen_agentchat.messages import ToolCallExecutionEvent
from autogen_core import FunctionCall
from autogen_core.models import CreateResult, ModelFamily, ModelInfo, RequestUsage
from autogen_ext.code_executors.docker_jupyter import DockerJupyterCodeExecutor
from autogen_ext.code_executors.docker_jupyter._jupyter_server import JupyterConnectionInfo
from autogen_ext.models.replay import ReplayChatCompletionClient
from autogen_ext.tools.code_execution import PythonCodeExecutionTool

STEP_1 = "total = 40\nopen('/tmp/step1.txt', 'w').write('2')\nprint('stored')"
STEP_2 = "total + int(open('/tmp/step1.txt').read())"


def code_call(code: str, call_id: str) -> CreateResult:
    call = FunctionCall(id=call_id, name="CodeExecutor", arguments=json.dumps({"code": code}))
    usage = RequestUsage(prompt_tokens=0, completion_tokens=0)
    return CreateResult(finish_reason="function_calls", content=[call], usage=usage, cached=False)


async def main() -> None:
    url = urlsplit(os.environ["KERNELHOST_URL"])
    assert url.hostname is not None
    server = JupyterConnectionInfo(
        host=url.hostname, use_https=False, port=url.port, token=os.environ["KERNELHOST_API_KEY"]
    )
    model = ReplayChatCompletionClient(
        [code_call(STEP_1, "c1"), code_call(STEP_2, "c2"), "done"],
        model_info=ModelInfo(
            vision=False,
            function_calling=True,
            json_output=False,
            family=ModelFamily.UNKNOWN,
            structured_output=False,
        ),
    )
    async with DockerJupyterCodeExecutor(jupyter_server=server, timeout=240) as executor:
        agent = AssistantAgent(
            "coder", model_client=model, tools=[PythonCodeExecutionTool(executor)], max_tool_iterations=3
        )
        result = await agent.run(task="Store 40 and 2 in the sandbox, then add them up.")
    outputs: list[Any] = [
        [{"content": item.content, "is_error": item.is_error} for item in message.content]
        for message in result.messages
        if isinstance(message, ToolCallExecutionEvent)
    ]
    last_request = [str(message) for message in model.create_calls[-1]["messages"]]
    final = result.messages[-1]
    print(
        json.dumps(
            {
                "outputs": outputs,
                "last_request": last_request,
                "final": getattr(final, "content", None),
                "calls": len(model.create_calls),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
