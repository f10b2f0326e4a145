"""envd's ``process.Process`` Connect service: ``Start`` streams a command's output and exit code
(``commands.run`` in E2B's SDKs), ``List`` shows the commands this surface is running,
``SendSignal`` interrupts one.

A command runs in the sandbox's shell (the one ``language="bash"`` executions use) in a
subshell of its own, so its ``cd``, exports and ``cwd``/``envs`` end with it, as an E2B
process's do. Calls to one sandbox run one at a time: a background command holds the sandbox
until it ends. Input to a running command (``send_stdin``), PTYs and reattaching to a command
(``connect``) are not supported and answer ``unimplemented`` saying so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import shlex
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ...sandboxes import End, ExecutionStatus, InvalidRequest, SandboxError, Stream
from .common import runtime, sandbox_of
from .connect import (
    STREAM_CONTENT_TYPE,
    UNARY_CONTENT_TYPE,
    ConnectError,
    end_stream,
    envelope,
    parse_message,
    parse_stream_request,
)
from .envs import bash_prefix, check_names

HOME = "/home/user"
KEEPALIVE_DEFAULT = 50.0  # seconds, when the client names no Keepalive-Ping-Interval


@dataclass
class Running:
    """The commands this surface runs, per sandbox: what ``List`` shows."""

    pids: itertools.count[int] = field(default_factory=lambda: itertools.count(1000))
    by_sandbox: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)


RUNNING = web.AppKey("e2b_running", Running)


def command_line(config: dict[str, Any]) -> str:
    cmd, args = config.get("cmd"), config.get("args") or []
    if (
        not isinstance(cmd, str)
        or not cmd
        or not isinstance(args, list)
        or not all(isinstance(a, str) for a in args)
    ):
        raise ConnectError(
            "invalid_argument", "process.cmd must be a program and process.args a list of strings"
        )
    if cmd in ("/bin/bash", "bash", "/bin/sh", "sh") and len(args) >= 2 and args[-2] == "-c":
        return str(args[-1])  # what E2B's SDKs send: bash -l -c "<the command>"
    return shlex.join([cmd, *args])


def script(config: dict[str, Any]) -> str:
    line = command_line(config)
    envs = config.get("envs") or {}
    if not isinstance(envs, dict) or not all(isinstance(v, str) for v in envs.values()):
        raise ConnectError("invalid_argument", "process.envs must be an object of strings")
    try:
        check_names(envs)
    except InvalidRequest as exc:
        raise ConnectError("invalid_argument", exc.message) from None
    cwd = config.get("cwd")
    if cwd is not None and not isinstance(cwd, str):
        raise ConnectError("invalid_argument", "process.cwd must be a path")
    # as an E2B process: in the user's home unless told, with HOME there
    enter = f"export HOME={HOME}\ncd -- {shlex.quote(cwd or HOME)} || exit 1\n"
    return f"(\n{enter}{bash_prefix(envs)}{line}\n)"


def _deadline(request: web.Request) -> float | None:
    raw = request.headers.get("Connect-Timeout-Ms")
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms={raw!r} is not a number") from None
    return ms / 1000 if ms > 0 else None


def _keepalive(request: web.Request) -> float:
    try:
        return max(1.0, float(request.headers.get("Keepalive-Ping-Interval", KEEPALIVE_DEFAULT)))
    except ValueError:
        return KEEPALIVE_DEFAULT


def _event(**event: Any) -> bytes:
    return envelope({"event": event})


async def start(request: web.Request) -> web.StreamResponse:
    try:
        message = parse_stream_request(await request.read())
        config = message.get("process")
        if not isinstance(config, dict):
            raise ConnectError("invalid_argument", "process is required")
        if message.get("pty"):
            raise ConnectError(
                "unimplemented", "PTYs are not supported by kernelhost; run the command without pty"
            )
        code = script(config)
        sbx = sandbox_of(request)
        events = await runtime(request).manager.execute(sbx, code, "bash", _deadline(request))
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        err = ConnectError(
            "invalid_argument" if isinstance(exc, InvalidRequest) else "unavailable", exc.message
        )
        return web.json_response(err.wire(), status=err.status)
    running = request.app[RUNNING]
    pid = next(running.pids)
    running.by_sandbox.setdefault(sbx.id, {})[pid] = {"config": config, "pid": pid}
    resp = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
    await resp.prepare(request)
    try:
        await resp.write(_event(start={"pid": pid}))
        await _relay(resp, events, _keepalive(request))
    finally:
        running.by_sandbox.get(sbx.id, {}).pop(pid, None)
    await resp.write_eof()
    return resp


async def _relay(resp: web.StreamResponse, events: Any, keepalive: float) -> None:
    """Output as data events, a keepalive when the command is quiet, the end with its code."""
    async with contextlib.aclosing(events):
        iterator = events.__aiter__()
        pending: asyncio.Task[Any] | None = None
        try:
            while True:
                pending = pending or asyncio.ensure_future(iterator.__anext__())
                done, _ = await asyncio.wait({pending}, timeout=keepalive)
                if not done:
                    await resp.write(_event(keepalive={}))
                    continue
                pending = None
                try:
                    event = done.pop().result()
                except StopAsyncIteration:
                    await resp.write(
                        end_stream(ConnectError("internal", "the command ended without an exit code"))
                    )
                    return
                if isinstance(event, Stream):
                    data = base64.b64encode(event.text.encode()).decode()
                    await resp.write(_event(data={event.name: data}))
                elif isinstance(event, End):
                    await resp.write(_end(event))
                    return
        finally:
            if pending is not None:
                pending.cancel()


def _end(event: End) -> bytes:
    if event.status == ExecutionStatus.TIMEOUT:
        return end_stream(
            ConnectError("deadline_exceeded", "the command ran past its timeout and was stopped")
        )
    code = (
        event.exit_code if event.exit_code is not None else (0 if event.status == ExecutionStatus.OK else 1)
    )
    end: dict[str, Any] = {"exitCode": code, "exited": True, "status": f"exit status {code}"}
    if event.status not in (ExecutionStatus.OK, ExecutionStatus.ERROR):
        end["error"] = f"the command ended: {event.status.value}"
    return _event(end=end) + end_stream()


async def list_processes(request: web.Request) -> web.Response:
    sbx = sandbox_of(request)
    procs = list(request.app[RUNNING].by_sandbox.get(sbx.id, {}).values())
    return web.json_response({"processes": procs}, content_type=UNARY_CONTENT_TYPE)


async def send_signal(request: web.Request) -> web.Response:
    sbx = sandbox_of(request)
    try:
        message = parse_message(await request.read())
        pid = (message.get("process") or {}).get("pid")
        if pid not in request.app[RUNNING].by_sandbox.get(sbx.id, {}):
            raise ConnectError("not_found", f"no process {pid!r} in sandbox {sbx.id}")
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    await runtime(request).manager.interrupt(sbx)
    return web.json_response({}, content_type=UNARY_CONTENT_TYPE)


async def unsupported(request: web.Request) -> web.Response:
    method = request.match_info["method"]
    err = ConnectError(
        "unimplemented",
        f"process.{method} is not supported by kernelhost (no input to a running command, no PTY, "
        "no reattaching); supported: Start, List, SendSignal",
    )
    return web.json_response(err.wire(), status=err.status)


def add_routes(app: web.Application, prefix: str) -> None:
    app[RUNNING] = Running()
    r = app.router
    r.add_post(f"{prefix}/process.Process/Start", start)
    r.add_post(f"{prefix}/process.Process/List", list_processes)
    r.add_post(f"{prefix}/process.Process/SendSignal", send_signal)
    r.add_post(f"{prefix}/process.Process/{{method}}", unsupported)
