"""E2B's code interpreter (the Jupyter server on port 49999 of an E2B sandbox):
``POST /execute`` streamed as the NDJSON lines ``e2b_code_interpreter`` parses, and the contexts
API. A kernelhost sandbox has one kernel and one shell; its contexts are those two, by language
(``python``, or the template's kernel language, and ``bash``), and a context's restart restarts
the kernel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
from typing import Any

from aiohttp import web

from ...sandboxes import End, Error, ExecutionStatus, InvalidRequest, Result, SandboxError, Stream
from .common import SandboxGone, break_transport, check_not_gone, runtime, sandbox_of
from .envs import PYTHON_POP, bash_prefix, check_names, kernel_language, python_push, run_quietly

HOME = "/home/user"
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


def _language(kernel: str, asked: Any, context_id: Any) -> str:
    """Our execute language (``python``: the kernel, whatever it runs; ``bash``)."""
    chosen = context_id if asked is None else asked
    if chosen is None:
        return "python"
    if not isinstance(chosen, str):
        raise InvalidRequest(f"language={chosen!r} must be a string")
    chosen = chosen.lower()
    if chosen in ("bash", "sh", "shell"):
        return "bash"
    if chosen == kernel:
        return "python"
    raise InvalidRequest(
        f"language {chosen!r} is not in this sandbox: its kernel runs {kernel} and its shell bash; "
        "create the sandbox from a template with that kernel"
    )


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
        language = _language(kernel_language(manager, sbx), body.get("language"), body.get("context_id"))
        env = body.get("env_vars") or {}
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise InvalidRequest("env_vars must be an object of strings")
        check_names(env)
        code = body["code"]
        if env and language == "bash":
            code = f"(\n{bash_prefix(env)}{code}\n)"  # in a subshell: for this execution only
        elif env:
            await run_quietly(manager, sbx, python_push(env))
        events = await manager.execute(sbx, code, language)
    except InvalidRequest as exc:
        return _text_error(400, exc.message)
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
                await asyncio.shield(run_quietly(manager, sbx, PYTHON_POP))
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


def _line(line: dict[str, Any]) -> bytes:
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def _context(language: str) -> dict[str, str]:
    return {"id": language, "language": language, "cwd": HOME}


async def create_context(request: web.Request) -> web.Response:
    sbx = sandbox_of(request)
    raw = await request.read() if request.body_exists else b""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return _text_error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return _text_error(400, "the request body must be a JSON object")
    manager = runtime(request).manager
    kernel = kernel_language(manager, sbx)
    language = str(body.get("language") or kernel).lower()
    if language not in (kernel, "bash"):
        return _text_error(400, f"language {language!r}: this sandbox has a {kernel} kernel and bash")
    cwd = body.get("cwd")
    if cwd not in (None, HOME):
        return _text_error(
            400,
            f"cwd={cwd!r}: a kernelhost sandbox has one context per language, in {HOME}; "
            f"change directory in your code (os.chdir, cd {shlex.quote(str(cwd))})",
        )
    return web.json_response(_context(language))


async def list_contexts(request: web.Request) -> web.Response:
    sbx = sandbox_of(request)
    kernel = kernel_language(runtime(request).manager, sbx)
    return web.json_response([_context(kernel), _context("bash")])


async def restart_context(request: web.Request) -> web.Response:
    sbx = sandbox_of(request)
    if request.match_info["context_id"] == "bash":
        return _text_error(400, "the bash context has no kernel to restart")
    await runtime(request).manager.restart(sbx)
    return web.json_response({})


async def remove_context(request: web.Request) -> web.Response:
    sandbox_of(request)
    return _text_error(
        400, "a kernelhost sandbox's contexts are its kernel and shell; they cannot be removed"
    )


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_post(f"{prefix}/execute", execute)
    r.add_post(f"{prefix}/contexts", create_context)
    r.add_get(f"{prefix}/contexts", list_contexts)
    r.add_post(f"{prefix}/contexts/{{context_id}}/restart", restart_context)
    r.add_delete(f"{prefix}/contexts/{{context_id}}", remove_context)
