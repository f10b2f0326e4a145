"""Code contexts: kernels of their own in a sandbox, beside its main kernel.

A sandbox has one main kernel (its template's) and bash. A code context is another kernel in the
same VM, started by the guest agent (``Capability.CONTEXTS``): its own process, variables,
working directory and language (any kernelspec the guest holds: the template's, and Python in
every image). Files, the network and the VM are shared. Cells of a context run through the
same execution path as the main kernel's (``SandboxManager.execute(..., context=id)``), one call
at a time per sandbox, with the same timeout ladder; its rungs act on the context's kernel
(interrupt, then restart it), and only an unresponsive agent costs the VM.

The guest is the one record of which contexts exist: they live in its RAM, so they come along
through hibernation, fork and checkpoints, and are gone with a replaced VM. A context started
with ``default=True`` is its language's default one (E2B's ``run_code(language=...)``); the
guest keeps that mark, so a fork's child or a restarted service finds it again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...channel import AgentError
from ...channel.protocol import Capability, Op
from ...config import Settings
from ..errors import (
    AgentUnresponsive,
    ContextNotFound,
    InvalidRequest,
)
from ..sandbox import Sandbox, ensure_usable
from .files import WaitForVm, agent_request

#: what a guest's error text may add to ours (it is the guest's, so it is bounded)
GUEST_TEXT_MAX = 300
#: the id the main kernel has as a context (its language is the template's)
MAIN = "main"


@dataclass(frozen=True)
class CodeContext:
    """One code context of a sandbox (a guest's entry named ``MAIN`` is dropped: that name is
    the main kernel's)."""

    id: str
    language: str
    cwd: str
    kernel: str = ""
    default: bool = False

    @classmethod
    def parse(cls, entry: Any) -> CodeContext | None:
        """One of the guest's entries, if it is sane (the guest is not trusted)."""
        if not isinstance(entry, dict):
            return None
        cid, language, cwd = entry.get("context"), entry.get("language"), entry.get("cwd")
        kernel = entry.get("kernel")
        if not (isinstance(cid, str) and 0 < len(cid) <= 64 and cid != MAIN):
            return None
        if not (isinstance(language, str) and isinstance(cwd, str) and isinstance(kernel, str)):
            return None
        return cls(cid, language.lower()[:64], cwd[:4096], kernel[:64], entry.get("default") is True)


class CodeContexts:
    """Start, list, restart and stop the code contexts of sandboxes."""

    def __init__(self, settings: Settings, wait_for_vm: WaitForVm) -> None:
        self.settings = settings
        self._wait_for_vm = wait_for_vm

    def kernels(self, sbx: Sandbox) -> dict[str, str]:
        """The guest's kernelspecs by language (from its ``hello``; empty before one)."""
        agent = sbx.agent
        found: dict[str, str] = {}
        for name, language in agent.info.kernels if agent is not None else ():
            found.setdefault(language, name)
        return found

    async def start(
        self, sbx: Sandbox, language: str, cwd: str | None = None, *, default: bool = False
    ) -> CodeContext:
        """A new context running ``language``'s kernel in ``cwd`` (created if missing)."""
        if cwd is not None and (not cwd.startswith("/") or "\0" in cwd or len(cwd) > 4096):
            raise InvalidRequest(
                f"cwd={cwd!r:.100} must be an absolute path (like /home/user/project)", field="cwd"
            )
        await self._ready(sbx)
        kernels = self.kernels(sbx)
        kernel = kernels.get(language.lower())
        if kernel is None:
            raise InvalidRequest(
                f"language {language!r} has no kernel in sandbox {sbx.id}; it has "
                f"{', '.join(sorted(kernels)) or 'none'} (a template with that kernel brings it)",
                field="language",
            )
        fields: dict[str, Any] = {"kernel": kernel, "default": default}
        if cwd is not None:
            fields["cwd"] = cwd
        reply = await self._request(sbx, Op.CONTEXT_START, self.settings.restart_timeout, **fields)
        made = CodeContext.parse(reply)
        if made is None:
            raise AgentUnresponsive(f"the agent of sandbox {sbx.id} answered a context start with nonsense")
        return made

    async def list(self, sbx: Sandbox) -> list[CodeContext]:
        """The sandbox's contexts, in the order they were started."""
        await self._ready(sbx)
        reply = await self._request(sbx, Op.CONTEXT_LIST, self.settings.agent_timeout)
        entries = reply.get("contexts")
        found = [CodeContext.parse(e) for e in entries[:256]] if isinstance(entries, list) else []
        return [c for c in found if c is not None]

    async def get(self, sbx: Sandbox, context_id: str) -> CodeContext:
        for ctx in await self.list(sbx):
            if ctx.id == context_id:
                return ctx
        raise ContextNotFound(sbx.id, context_id)

    async def default_for(self, sbx: Sandbox, language: str) -> CodeContext:
        """``language``'s default context, started on first use."""
        for ctx in await self.list(sbx):
            if ctx.default and ctx.language == language.lower():
                return ctx
        return await self.start(sbx, language, default=True)

    async def restart(self, sbx: Sandbox, context_id: str) -> None:
        """A fresh kernel for the context (its variables are lost; its cwd is kept)."""
        await self.get(sbx, context_id)
        await self._request(sbx, Op.CONTEXT_RESTART, self.settings.restart_timeout, context=context_id)

    async def stop(self, sbx: Sandbox, context_id: str) -> None:
        """End the context's kernel and forget it."""
        await self.get(sbx, context_id)
        await self._request(sbx, Op.CONTEXT_STOP, self.settings.restart_timeout, context=context_id)

    async def stop_all(self, sbx: Sandbox) -> int:
        """End every context (a pause that keeps the files only); how many there were. An
        image without contexts has none."""
        agent = sbx.live_agent
        if agent is None or not agent.supports(Capability.CONTEXTS):
            return 0
        found = await self.list(sbx)
        for ctx in found:
            await self._request(sbx, Op.CONTEXT_STOP, self.settings.restart_timeout, context=ctx.id)
        return len(found)

    async def _ready(self, sbx: Sandbox) -> None:
        await self._wait_for_vm(sbx)
        ensure_usable(sbx)

    async def _request(self, sbx: Sandbox, op: Op, wait: float, **fields: Any) -> dict[str, Any]:
        try:
            return await agent_request(sbx, op, wait, "code contexts", **fields)
        except AgentError as exc:
            said = str(exc)[:GUEST_TEXT_MAX]
            raise InvalidRequest(f"sandbox {sbx.id} refused {op}: {said}") from exc
