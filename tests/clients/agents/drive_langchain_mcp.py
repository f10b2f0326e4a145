"""Driver of test_langchain_mcp.py, run with the LangChain MCP virtualenv's Python (isolated.py):
LangChain's MCP adapters load kernelhost's tools from ``$KERNELHOST_URL/mcp``, and a chat model
of langchain-core's fake models (``GenericFakeChatModel``, whose replies are built from the tool
messages it was sent) calls them in a tool loop. Prints one JSON line of what came back."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from typing import Any

from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_mcp_adapters.client import MultiServerMCPClient

STEP_1 = "total = 40\nopen('/tmp/step1.txt', 'w').write('2')\nprint('stored')"
STEP_2 = "total + int(open('/tmp/step1.txt').read())"


def structured(message: BaseMessage) -> dict[str, Any]:
    """The MCP tool's structured result, which the adapters keep as the message's artifact."""
    assert isinstance(message, ToolMessage), message
    assert message.status == "success", message.content
    content: dict[str, Any] = message.artifact["structured_content"]
    return content


def script(history: list[BaseMessage]) -> Iterator[AIMessage]:
    """The model's replies, each made when the model is called, from the history so far."""
    yield AIMessage("", tool_calls=[{"name": "run_code", "args": {"code": STEP_1}, "id": "c1"}])
    sandbox_id = structured(history[-1])["sandbox_id"]
    args = {"code": STEP_2, "sandbox_id": sandbox_id}
    yield AIMessage("", tool_calls=[{"name": "run_code", "args": args, "id": "c2"}])
    result = structured(history[-1])["result"]
    yield AIMessage(
        "", tool_calls=[{"name": "close_sandbox", "args": {"sandbox_id": sandbox_id}, "id": "c3"}]
    )
    yield AIMessage(f"total is {result}")


async def main() -> None:
    client = MultiServerMCPClient(
        {
            "kernelhost": {
                "transport": "streamable_http",
                "url": os.environ["KERNELHOST_URL"] + "/mcp",
                "headers": {"Authorization": f"Bearer {os.environ['KERNELHOST_API_KEY']}"},
                "timeout": 300,
                "sse_read_timeout": 300,
            }
        }
    )
    tools = {tool.name: tool for tool in await client.get_tools()}
    history: list[BaseMessage] = [HumanMessage("Store 40 and 2 in the sandbox, then add them up.")]
    model = GenericFakeChatModel(messages=script(history))
    while True:
        reply = await model.ainvoke(history)
        history.append(reply)
        assert isinstance(reply, AIMessage)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            history.append(await tools[call["name"]].ainvoke({**call, "type": "tool_call"}))
    results = [structured(m) for m in history if isinstance(m, ToolMessage)]
    texts = [m.content for m in history if isinstance(m, ToolMessage)]
    print(json.dumps({"tools": sorted(tools), "results": results, "texts": texts, "final": reply.content}))


if __name__ == "__main__":
    asyncio.run(main())
