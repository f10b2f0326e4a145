"""E2B's code contexts (``/contexts`` of the code interpreter), and which kernel an ``/execute``
runs on.

A sandbox's main kernel is the context named by its language (``python``, or the template's
kernel language), and its shell the context ``bash``: both always there, neither removable.
Every context created here is a kernel of its own in the VM (``sandboxes/inside/contexts.py``), with
its own variables, working directory and language, restarted and removed on its own. An
``/execute`` with a ``language`` other than the main kernel's and bash runs in that language's
default context, started on first use, as E2B's interpreter does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ...sandboxes import CodeContext, InvalidRequest, Sandbox, SandboxError, SandboxManager
from ..errors import status_for
from .common import HOME, runtime, sandbox_of
from .envs import kernel_language

BASH = "bash"
SHELL_NAMES = frozenset({"bash", "sh", "shell"})
ALIASES = {"js": "javascript", "ts": "typescript"}

View = Callable[[web.Request], Awaitable[web.StreamResponse]]


def text_error(status: int, message: str) -> web.Response:
    """The interpreter's errors are plain text, as E2B's (its SDK shows the body)."""
    return web.Response(status=status, text=message)


def plain_errors(view: View) -> View:
    @functools.wraps(view)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        try:
            return await view(request)
        except SandboxError as exc:
            return text_error(status_for(exc), exc.message)

    return wrapped


def normalize(language: Any) -> str | None:
    """E2B's spelling of a language (``js`` is ``javascript``), or None when not given."""
    if language is None or language == "":
        return None
    if not isinstance(language, str):
        raise InvalidRequest(f"language={language!r:.80} must be a string", field="language")
    lowered = language.strip().lower()
    return ALIASES.get(lowered, lowered)


async def target(
    manager: SandboxManager, sbx: Sandbox, language: Any, context_id: Any
) -> tuple[str, str | None]:
    """Where an ``/execute`` runs: (``python`` for a kernel or ``bash``, the context or None for
    the main kernel). ``ContextNotFound`` (404) for a context the sandbox does not have."""
    chosen = normalize(language)
    if chosen is not None and context_id is not None:
        raise InvalidRequest("Only one of context_id or language can be provided", field="context_id")
    main = kernel_language(manager, sbx)
    if context_id is not None:
        if not isinstance(context_id, str) or not context_id:
            raise InvalidRequest(f"context_id={context_id!r:.80} must be a context's id", field="context_id")
        if context_id.lower() in SHELL_NAMES:
            return BASH, None
        if context_id.lower() == main:
            return "python", None
        return "python", (await manager.contexts.get(sbx, context_id)).id
    if chosen is None or chosen == main:
        return "python", None
    if chosen in SHELL_NAMES:
        return BASH, None
    return "python", (await manager.contexts.default_for(sbx, chosen)).id


def view_of(ctx: CodeContext) -> dict[str, str]:
    return {"id": ctx.id, "language": ctx.language, "cwd": ctx.cwd}


def _fixed(language: str) -> dict[str, str]:
    """The main kernel's context and the shell's (ids are their languages)."""
    return {"id": language, "language": language, "cwd": HOME}


@plain_errors
async def create_context(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    raw = await request.read() if request.body_exists else b""
    try:
        body = json.loads(raw) if raw else {}
    except ValueError:
        return text_error(400, "the request body is not JSON")
    if not isinstance(body, dict):
        return text_error(400, "the request body must be a JSON object")
    manager = runtime(request).manager
    language = normalize(body.get("language")) or "python"
    cwd = body.get("cwd") or HOME
    if not isinstance(cwd, str):
        return text_error(400, f"cwd={cwd!r:.80} must be a path")
    if language in SHELL_NAMES:
        return text_error(
            400, f"language {language!r} has no kernel: run commands with language='bash' and no context"
        )
    made = await manager.contexts.start(sbx, language, cwd)
    return web.json_response(view_of(made))


@plain_errors
async def list_contexts(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    manager = runtime(request).manager
    own = [view_of(c) for c in await manager.contexts.list(sbx)]
    return web.json_response([_fixed(kernel_language(manager, sbx)), _fixed(BASH), *own])


@plain_errors
async def restart_context(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    manager = runtime(request).manager
    context_id = request.match_info["context_id"]
    if context_id.lower() in SHELL_NAMES:
        return text_error(400, "the bash context has no kernel to restart")
    if context_id.lower() == kernel_language(manager, sbx):
        await manager.restart(sbx)
    else:
        await manager.contexts.restart(sbx, context_id)
    return web.json_response({})


@plain_errors
async def remove_context(request: web.Request) -> web.StreamResponse:
    sbx = sandbox_of(request)
    manager = runtime(request).manager
    context_id = request.match_info["context_id"]
    if context_id.lower() in SHELL_NAMES or context_id.lower() == kernel_language(manager, sbx):
        return text_error(
            400,
            f"context {context_id!r} is the sandbox's own kernel or shell and stays; restart it, "
            "or remove the contexts you created",
        )
    await manager.contexts.stop(sbx, context_id)
    return web.json_response({})


def add_routes(app: web.Application, prefix: str) -> None:
    r = app.router
    r.add_post(f"{prefix}/contexts", create_context)
    r.add_get(f"{prefix}/contexts", list_contexts)
    r.add_post(f"{prefix}/contexts/{{context_id}}/restart", restart_context)
    r.add_delete(f"{prefix}/contexts/{{context_id}}", remove_context)
