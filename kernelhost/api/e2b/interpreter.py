"""E2B's code interpreter (the Jupyter server on port 49999 of an E2B sandbox):
``POST /execute`` streamed as the NDJSON lines ``e2b_code_interpreter`` parses. Which kernel it
runs on (the main one, a code context's, or bash) and the contexts API are ``contexts.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

from aiohttp import web

from ...sandboxes import (
    End,
    Error,
    ExecutionStatus,
    InvalidRequest,
    Result,
    Sandbox,
    SandboxError,
    SandboxManager,
    Stream,
)
from ..errors import status_for
from . import contexts
from .common import SandboxGone, break_transport, check_not_gone, runtime, sandbox_of
from .envs import PYTHON_POP, bash_prefix, check_names, kernel_language, python_push, run_quietly

#: MIME types E2B's Result names as fields; others go to ``extra``
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    # the guest kernel's E2B formatters (guest-image/agent/kernel_displays.py): a DataFrame's
    # columns, a matplotlib figure's chart; objects, as E2B's interpreter sends them
    "e2b/data": "data",
    "e2b/chart": "chart",
}
OBJECT_FIELDS = ("json", "data", "chart")


def _text_error(status: int, message: str) -> web.Response:
    return web.Response(status=status, text=message)


def result_line(event: Result) -> dict[str, Any]:
    line: dict[str, Any] = {"type": "result", "is_main_result": event.is_main_result}
    extra: dict[str, Any] = {}
    for mime, value in event.data.items():
        field = MIME_FIELDS.get(mime)
        if field == "text" and isinstance(value, str):
            value = strip_quotes(value)
        if field is None:
            extra[mime] = value
        elif field in OBJECT_FIELDS:
            line[field] = value if isinstance(value, dict) else {"value": value}
        else:
            line[field] = value if isinstance(value, str) else json.dumps(value)
    if extra:
        line["extra"] = extra
    return line


def strip_quotes(text: str) -> str:
    """A result's ``text/plain`` as E2B's interpreter gives it: one pair of surrounding single
    quotes taken off (a ``str`` result's repr), so ``os.getenv('X')`` is ``value``."""
    if text.startswith("'") and text.endswith("'"):
        return text[1:-1]
    return text


def lines_of(event: Any, errored: bool) -> list[dict[str, Any]]:
    if isinstance(event, Stream):
        return [{"type": event.name, "text": event.text, "timestamp": time.time_ns()}]
    if isinstance(event, Result):
        # E2B's interpreter shows displays once: a new version of one (update_display) is not sent
        return [] if event.update else [result_line(event)]
    if isinstance(event, Error):
        return [
            {
                "type": "error",
                "name": event.name,
                "value": event.value,
                "traceback": "\n".join(event.traceback),
            }
        ]
    if isinstance(event, End):
        out: list[dict[str, Any]] = []
        if event.status != ExecutionStatus.OK and not errored:
            out.append({"type": "error", "name": "ExecutionError", "value": _ended(event), "traceback": ""})
        if event.execution_count is not None:
            out.append({"type": "number_of_executions", "execution_count": event.execution_count})
        return [*out, {"type": "end_of_execution"}]
    return []


def _ended(end: End) -> str:
    said = f"the execution ended: {end.status.value}"
    if end.language == "bash" and end.exit_code not in (None, 0):
        said += f" (exit code {end.exit_code})"
    if end.recovery is not None:
        said += f"; the sandbox recovered by {end.recovery.value}"
    return said


async def execute(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    try:
        body = await request.json()
    except ValueError:
        return _text_error(400, "the request body is not JSON")
    if not isinstance(body, dict) or not isinstance(body.get("code"), str):
        return _text_error(400, "the request body must be {'code': str, ...}")
    manager = runtime(request).manager
    try:
        language, context = await contexts.target(manager, sbx, body.get("language"), body.get("context_id"))
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise InvalidRequest("env_vars must be an object of strings")
        check_names(env)
        code = body["code"]
        if env and language == "bash":
            code = f"(\n{bash_prefix(env)}{code}\n)"  # in a subshell: for this execution only
        elif env:
            await _python_kernel(manager, sbx, context)
            await run_quietly(manager, sbx, python_push(env), context=context)
        events = await manager.execute(sbx, code, language, context=context)
    except SandboxError as exc:
        return _text_error(status_for(exc), exc.message)
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-store"})
    await resp.prepare(request)
    try:
        await _stream(request, resp, events)
    except SandboxGone:
        break_transport(request)
        return resp
    finally:
        if env and language == "python" and manager.find(sbx.id) is sbx:  # for this execution only
            with contextlib.suppress(SandboxError):
                await asyncio.shield(run_quietly(manager, sbx, PYTHON_POP, context=context))
    await resp.write_eof()
    return resp


async def _stream(request: web.Request, resp: web.StreamResponse, events: Any) -> None:
    """The execution's lines; ``SandboxGone`` instead of its end when the sandbox was killed."""
    errored = False
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, End):
                    check_not_gone(request)
                errored = errored or isinstance(event, Error)
                for line in lines_of(event, errored):
                    await resp.write(_line(line))
    except SandboxError as exc:  # after the stream began (a wake refused, the VM lost): in-band
        check_not_gone(request)
        await resp.write(
            _line({"type": "error", "name": type(exc).__name__, "value": exc.message, "traceback": ""})
        )
        await resp.write(_line({"type": "end_of_execution"}))


async def _python_kernel(manager: SandboxManager, sbx: Sandbox, context: str | None) -> None:
    """``env_vars`` are set by Python code: the kernel must be a Python one."""
    language = (
        kernel_language(manager, sbx)
        if context is None
        else (await manager.contexts.get(sbx, context)).language
    )
    if language != "python":
        raise InvalidRequest(
            f"env_vars are set for Python kernels and bash; this one runs {language}: set them in "
            "your code, or at the sandbox's create (envs)",
            field="env_vars",
        )


def _line(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_post(f"{prefix}/execute", execute)
    contexts.add_routes(app, prefix)
