"""A second kernel, started ahead and idle, that a restart puts in the first one's place.

A kernel restart under emulation waits seconds for a new Python to import ipykernel; with a
standby the restart is a swap: the agent connects to the standby's sockets, kills the old
process, and has a kernel answering within a fraction of a second. The standby is started once
the sandbox's kernel is ready (and waited for before a template is frozen, so every clone has
it for nothing); after a swap a new one is started in the background.

A promoted standby must look like a fresh kernel of this sandbox: the environment the agent has
set since the standby started (the network's proxy variables) is set in it, and its random
streams are reseeded (a template's standby is the same in every clone).

The standby holds guest memory (a template's preloads: ~140 MB in ``python-datasci``) that the
user's kernel may need more: the guest's OOM killer takes it before any other process
(``oom_score_adj`` 1000, set back to 0 when it is promoted). A standby that died is not
promoted; the restart then starts a process the slow way, and the next standby after it.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
from collections.abc import Callable
from typing import Any

from .accounts import AccountKernelManager
from .config import AgentConfig
from .shared import log, log_exception

__all__ = ["Standby"]

MakeManager = Callable[[str | None], AccountKernelManager]  # Kernel._manager

_generations = itertools.count(1)
OOM_FIRST = 1000  # the kernel's oom_score_adj range is -1000..1000: the first one it kills


class Standby:
    """One kernel process started ahead: ``start``, ``run`` cells in it, then ``take`` it."""

    def __init__(self, config: AgentConfig, make_manager: MakeManager) -> None:
        self.config = config
        name = None
        if config.connection_file is not None:
            name = f"{config.connection_file}.standby-{next(_generations)}"
        self.km = make_manager(name)
        self.env: dict[str, str] = {}  # the environment it was started with
        self.account = config.identity.account  # the user it runs as (None: root)
        self.ready = asyncio.Event()
        self.failed = False
        self._client: Any = None

    async def start(self) -> None:
        """Start the process and wait until it answers (``ready``); ``failed`` if it did not."""
        try:
            self.env = dict(self.config.environ)
            self.account = self.config.identity.account
            await self.km.start_kernel(
                cwd=self.config.kernel_cwd,
                env=self.env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._oom_score_adj(OOM_FIRST)
            self._client = self.km.client(context=self.km.context)
            self._client.start_channels(hb=False)
            await self._client.wait_for_ready(timeout=self.config.ready_timeout)
            self.ready.set()
        except Exception:
            self.failed = True
            log_exception("the standby kernel did not start; restarts start a kernel afresh:")
            await self.stop()

    async def run(self, code: str, timeout: float) -> None:
        """One cell in the standby, without history (a warm-up or a preload before a freeze)."""
        if not self.ready.is_set() or self._client is None:
            return
        reply = await self._client.execute_interactive(
            code, silent=False, store_history=False, timeout=timeout, output_hook=lambda _msg: None
        )
        content = reply.get("content", {})
        if content.get("status") not in ("ok", "error"):
            log(f"a standby cell ended {content.get('status')!r}")

    def take(self) -> AccountKernelManager | None:
        """The ready kernel's manager, handed over (its own client closed) as an ordinary
        process for the OOM killer; None if not ready. (A ready one that died is the caller's
        to stop: ``alive``.)"""
        if not self.ready.is_set() or self.failed:
            return None
        self._oom_score_adj(0)
        self._close_client()
        self.ready.clear()
        return self.km

    def alive(self) -> bool:
        """Whether its process runs (the OOM killer may have taken it)."""
        process = getattr(self.km.provisioner, "process", None)
        return process is not None and process.poll() is None

    def _oom_score_adj(self, value: int) -> None:
        pid = getattr(self.km.provisioner, "pid", None)
        if not isinstance(pid, int) or isinstance(pid, bool):
            return
        try:
            with open(f"/proc/{pid}/oom_score_adj", "w") as f:
                f.write(f"{value}\n")
        except OSError as exc:  # gone already, or not allowed (a test host without root)
            log(f"cannot set the standby's oom_score_adj to {value}: {exc}")

    def env_changes(self) -> tuple[dict[str, str], list[str]]:
        """What the agent's environment set and unset since the standby started."""
        now = self.config.environ
        changed = {k: v for k, v in now.items() if self.env.get(k) != v}
        return changed, sorted(set(self.env) - set(now))

    def _close_client(self) -> None:
        if self._client is not None:
            self._client.stop_channels()
            self._client = None

    async def stop(self) -> None:
        """Shut the standby down (the agent stops, or it failed); idempotent."""
        self._close_client()
        self.ready.clear()
        try:
            if self.km.has_kernel:
                async with asyncio.timeout(self.config.ready_timeout):
                    await self.km.shutdown_kernel(now=True)
        except Exception:
            log_exception("standby kernel shutdown failed:")
