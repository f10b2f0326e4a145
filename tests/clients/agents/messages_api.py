"""A scripted, local stand-in for Anthropic's Messages API (``POST /v1/messages``).

It serves on 127.0.0.1 from a thread of its own (so blocking and async clients can both call
it), answers each request with the next step of a script, records what it was sent, and
enforces the rules of the real API that matter to a tool-use loop (contracts.md §1.6, §1.9):

- every ``tool_use`` of an assistant turn has a ``tool_result`` in the very next user message,
  and ``tool_result`` blocks come first in it;
- every ``server_tool_use`` in the history is followed by its result block in the same message
  (server tool results are round-tripped verbatim).

A step is a response (``{"content": [...], "stop_reason": ...}``) or a function of the request
body returning one, which may be a coroutine function (a gateway that runs tools itself).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web

Step = dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any] | Awaitable[dict[str, Any]]]

SERVER_RESULT_TYPES = {
    "bash_code_execution": "bash_code_execution_tool_result",
    "text_editor_code_execution": "text_editor_code_execution_tool_result",
    "code_execution": "code_execution_tool_result",
}
START_TIMEOUT = 10.0


def _bad_request(message: str) -> web.Response:
    return web.json_response(
        {"type": "error", "error": {"type": "invalid_request_error", "message": message}}, status=400
    )


def check_history(messages: list[dict[str, Any]]) -> str | None:
    """The first rule of the real API the history breaks, or None."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            continue
        if message.get("role") == "assistant":
            for j, block in enumerate(content):
                if block.get("type") == "server_tool_use":
                    want = SERVER_RESULT_TYPES.get(block["name"])
                    later = content[j + 1 :]
                    if not any(b.get("type") == want and b.get("tool_use_id") == block["id"] for b in later):
                        return (
                            f"tool use with id {block['id']} was found without a corresponding {want} block"
                        )
            pending = [b["id"] for b in content if b.get("type") == "tool_use"]
            if not pending:
                continue
            if i + 1 >= len(messages) or messages[i + 1].get("role") != "user":
                return f"tool_use ids {pending} have no tool_result in the next user message"
            reply = messages[i + 1].get("content")
            blocks = reply if isinstance(reply, list) else []
            results = list(itertools.takewhile(lambda b: b.get("type") == "tool_result", blocks))
            if any(b.get("type") == "tool_result" for b in blocks[len(results) :]):
                return "tool_result blocks must come first in the user message"
            answered = {b.get("tool_use_id") for b in results}
            if set(pending) - answered:
                return f"tool_use ids {sorted(set(pending) - answered)} have no tool_result"
    return None


class ScriptedMessagesAPI:
    """The fake API; ``url`` is its base URL once ``start()`` returned."""

    def __init__(self, script: Sequence[Step] | Sequence[Any]) -> None:
        self.script = list(script)
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, daemon=True, name="scripted-messages-api"
        )
        self._runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if not (
            request.headers.get("x-api-key") or request.headers.get("authorization", "").startswith("Bearer ")
        ):
            return web.json_response(
                {"type": "error", "error": {"type": "authentication_error", "message": "no API key"}},
                status=401,
            )
        problem = check_history(body.get("messages", []))
        if problem:
            return _bad_request(problem)
        if not self.script:
            return _bad_request(f"the script has no step left for request {len(self.requests)}")
        step = self.script.pop(0)
        if callable(step):
            answer = step(body)
            step = await answer if inspect.isawaitable(answer) else answer
        assert isinstance(step, dict)
        return web.json_response(
            {
                "id": f"msg_{len(self.requests):04d}",
                "type": "message",
                "role": "assistant",
                "model": body.get("model", "scripted"),
                "content": step["content"],
                "stop_reason": step["stop_reason"],
                "stop_sequence": None,
                "usage": {
                    "input_tokens": 10,
                    "output_tokens": 10,
                    **({"server_tool_use": step["server_tool_use"]} if "server_tool_use" in step else {}),
                },
            }
        )

    async def _start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/messages", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    def start(self) -> ScriptedMessagesAPI:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(START_TIMEOUT)
        return self

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(START_TIMEOUT)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(START_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> ScriptedMessagesAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
