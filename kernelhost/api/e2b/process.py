"""envd's ``process.Process`` Connect service over the sandbox layer's background processes
(``kernelhost/sandboxes/inside/processes.py``): ``Start`` streams a command's output and exit code
(``commands.run`` in E2B's SDKs, foreground or background), ``Connect`` follows a running one
again, ``List`` shows them, ``SendInput`` and ``CloseStdin`` write its stdin, ``SendSignal``
ends it.

A command runs in the sandbox's shell (the one ``language="bash"`` executions use) in a
subshell of its own, so its ``cd``, exports and ``cwd``/``envs`` end with it, as an E2B
process's do. It runs beside the sandbox's other calls: a background server does not hold up
``run_code``. A client that hangs up stops following it; the command runs on until it ends,
is killed, or reaches its timeout (the stream's ``Connect-Timeout-Ms``). PTYs and
``StreamInput`` answer ``unimplemented`` saying so.
"""

from __future__ import annotations

import base64
import contextlib
import shlex
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from aiohttp import web

from ...sandboxes import (
    CapacityExceeded,
    End,
    Error,
    Event,
    ExecutionStatus,
    InvalidRequest,
    NotSupportedByImage,
    Process,
    ProcessNotFound,
    SandboxError,
    Stream,
)
from .common import (
    SandboxGone,
    break_transport,
    check_not_gone,
    envd_path,
    envd_user,
    home_of,
    runtime,
    sandbox_of,
    with_keepalives,
)
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

KEEPALIVE_DEFAULT = 50.0  # seconds, when the client names no Keepalive-Ping-Interval


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


def script(config: dict[str, Any], user: str | None = None) -> str:
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
    # as an E2B process: in its user's home unless told, with HOME there
    home = home_of(user)
    where = envd_path(cwd, user) if cwd else home
    enter = f"export HOME={home}\ncd -- {shlex.quote(where)} || exit 1\n"
    return f"(\n{enter}{bash_prefix(envs)}{line}\n)"


def deadline(request: web.Request) -> float | None:
    raw = request.headers.get("Connect-Timeout-Ms")
    if raw is None:
        return None
    try:
        ms = int(raw)
    except ValueError:
        raise ConnectError("invalid_argument", f"Connect-Timeout-Ms={raw!r} is not a number") from None
    return ms / 1000 if ms > 0 else None


def keepalive_interval(request: web.Request) -> float:
    try:
        return max(1.0, float(request.headers.get("Keepalive-Ping-Interval", KEEPALIVE_DEFAULT)))
    except ValueError:
        return KEEPALIVE_DEFAULT


SHOWN = 120  # characters of one string of a process's config that the host keeps (List)
SHOWN_ITEMS = 16  # args, envs of a process's config that the host keeps


def shorten(text: str) -> str:
    return text if len(text) <= SHOWN else text[: SHOWN - 1] + "…"


def summary(config: dict[str, Any]) -> dict[str, Any]:
    """What the host keeps of a process's config for ``List`` (a few KiB at most, whatever
    was sent): each string cut at ``SHOWN`` characters (``…`` marks a cut), the first
    ``SHOWN_ITEMS`` args and envs. The command itself went to the guest whole."""
    out: dict[str, Any] = {"cmd": shorten(str(config.get("cmd", "")))}
    args = config.get("args") or []
    if isinstance(args, list):
        out["args"] = [shorten(str(a)) for a in args[:SHOWN_ITEMS]]
    envs = config.get("envs") or {}
    if isinstance(envs, dict):
        out["envs"] = {shorten(str(k)): shorten(str(v)) for k, v in list(envs.items())[:SHOWN_ITEMS]}
    if isinstance(config.get("cwd"), str):
        out["cwd"] = shorten(config["cwd"])
    return out


def _event(**event: Any) -> bytes:
    return envelope({"event": event})


def failure(exc: SandboxError) -> web.Response:
    code = {
        InvalidRequest: "invalid_argument",
        ProcessNotFound: "not_found",
        NotSupportedByImage: "unimplemented",
        CapacityExceeded: "resource_exhausted",  # a process limit: the message names it and the fix
    }.get(type(exc), "unavailable")
    err = ConnectError(code, exc.message)
    return web.json_response(err.wire(), status=err.status)


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
        stdin = message.get("stdin", False)
        if not isinstance(stdin, bool):
            raise ConnectError("invalid_argument", "stdin must be a boolean")
        user = envd_user(request)
        code = script(config, user)
        sbx = sandbox_of(request)
        tag = message.get("tag")
        info = {"config": summary(config), "tag": shorten(tag) if isinstance(tag, str) else None}
        proc = await runtime(request).manager.processes.start(
            sbx, code, deadline(request), stdin=stdin, info=info, user=user
        )
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        return failure(exc)
    return await _follow(request, proc)


async def connect(request: web.Request) -> web.StreamResponse:
    """Follow a running process again: its output from now, and its end."""
    try:
        message = parse_stream_request(await request.read())
        proc = _process(request, message)
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        return failure(exc)
    return await _follow(request, proc)


async def _follow(request: web.Request, proc: Process) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": STREAM_CONTENT_TYPE})
    await resp.prepare(request)
    await resp.write(_event(start={"pid": proc.pid}))
    try:
        await _relay(request, resp, proc.listen(), keepalive_interval(request))
    except SandboxGone:  # killed mid-command: the transport breaks, as E2B's
        break_transport(request)
        return resp
    await resp.write_eof()
    return resp


def _process(request: web.Request, message: dict[str, Any]) -> Process:
    """The process a request's ``process`` selector names (by pid; tags are not kept)."""
    sbx = sandbox_of(request)
    selector = message.get("process")
    if not isinstance(selector, dict) or "pid" not in selector:
        raise ConnectError("invalid_argument", "process must select a process by its pid")
    pid = selector["pid"]
    if not isinstance(pid, int):  # no process has it
        raise ProcessNotFound(sbx.id, pid)
    return runtime(request).manager.processes.get(sbx, pid)


async def _relay(
    request: web.Request, resp: web.StreamResponse, events: AsyncGenerator[Event, None], keepalive: float
) -> None:
    """Output as data events, a keepalive when the command is quiet, the end with its code;
    ``SandboxGone`` instead of the end when the sandbox was killed."""
    last_error: Error | None = None
    keepalives = with_keepalives(events, keepalive)
    async with contextlib.aclosing(events), contextlib.aclosing(keepalives) as items:
        async for event in items:
            if event is None:
                await resp.write(_event(keepalive={}))
            elif isinstance(event, Error):
                last_error = event
            elif isinstance(event, Stream):
                data = base64.b64encode(event.text.encode()).decode()
                await resp.write(_event(data={event.name: data}))
            elif isinstance(event, End):
                check_not_gone(request)
                await resp.write(_end(event))
                return
    check_not_gone(request)
    # no end: the listener was cut off, or the VM went
    why = last_error.value if last_error else "the command ended without an exit code"
    await resp.write(end_stream(ConnectError("unavailable", why)))


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
    procs = [
        {
            "pid": p.pid,
            "config": p.info.get("config") or {},
            **({"tag": p.info["tag"]} if p.info.get("tag") else {}),
        }
        for p in runtime(request).manager.processes.of(sbx)
        if "config" in p.info  # not the service's own (a usage reading)
    ]
    return web.json_response({"processes": procs}, content_type=UNARY_CONTENT_TYPE)


#: envd's Signal enum, in its JSON names and numbers
SIGNALS = {"SIGNAL_SIGKILL": "KILL", "SIGNAL_SIGTERM": "TERM", 9: "KILL", 15: "TERM"}


async def send_signal(request: web.Request) -> web.Response:
    return await _unary(request, _signal)


async def send_input(request: web.Request) -> web.Response:
    return await _unary(request, _input)


async def close_stdin(request: web.Request) -> web.Response:
    return await _unary(request, lambda proc, _: proc.send_input(b"", eof=True))


async def _signal(proc: Process, message: dict[str, Any]) -> None:
    name = SIGNALS.get(message.get("signal", "SIGNAL_SIGKILL"))
    if name is None:
        raise ConnectError("invalid_argument", f"signal {message.get('signal')!r} is not SIGKILL or SIGTERM")
    await proc.signal(name)


async def _input(proc: Process, message: dict[str, Any]) -> None:
    given = message.get("input")
    if not isinstance(given, dict) or not isinstance(given.get("stdin"), str):
        if isinstance(given, dict) and "pty" in given:
            raise ConnectError("unimplemented", "PTYs are not supported by kernelhost; send stdin")
        raise ConnectError("invalid_argument", "input.stdin (base64 bytes) is required")
    try:
        data = base64.b64decode(given["stdin"], validate=True)
    except ValueError:
        raise ConnectError("invalid_argument", "input.stdin is not base64") from None
    await proc.send_input(data)


async def _unary(
    request: web.Request, act: Callable[[Process, dict[str, Any]], Awaitable[None]]
) -> web.Response:
    try:
        message = parse_message(await request.read())
        await act(_process(request, message), message)
    except ConnectError as exc:
        return web.json_response(exc.wire(), status=exc.status)
    except SandboxError as exc:
        return failure(exc)
    return web.json_response({}, content_type=UNARY_CONTENT_TYPE)


async def unsupported(request: web.Request) -> web.Response:
    method = request.match_info["method"]
    err = ConnectError(
        "unimplemented",
        f"process.{method} is not supported by kernelhost (no PTY, no client-streamed input); "
        "supported: Start, Connect, List, SendInput, CloseStdin, SendSignal",
    )
    return web.json_response(err.wire(), status=err.status)


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_post(f"{prefix}/process.Process/Start", start)
    r.add_post(f"{prefix}/process.Process/Connect", connect)
    r.add_post(f"{prefix}/process.Process/List", list_processes)
    r.add_post(f"{prefix}/process.Process/SendSignal", send_signal)
    r.add_post(f"{prefix}/process.Process/SendInput", send_input)
    r.add_post(f"{prefix}/process.Process/CloseStdin", close_stdin)
    r.add_post(f"{prefix}/process.Process/{{method}}", unsupported)
