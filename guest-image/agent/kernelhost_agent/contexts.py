"""Code contexts: kernels of their own beside the sandbox's main kernel (E2B's code contexts).

``context_start`` starts a kernel of an installed kernelspec (default: the main kernel's) in a
working directory (default: the main kernel's; created if missing) and answers its id
(``ctx-`` and 12 hex digits). ``default: true`` marks it as its language's default context:
the agent only keeps and lists the mark (it lives in the guest's memory, so a fork's child and
a re-attached host find the same default context).

Each context is a ``Kernel`` and a ``Relay`` of its own, built from a copy of the agent's
configuration with the context's kernelspec, directory and connection file and no standby
kernel, so it has its own variables, cwd and language, is restarted when it dies, and is
metered per execution like the main kernel. Its frames to the
host, Jupyter messages and kernel events alike, carry ``"context": id``; a host ``jupyter``
frame with ``context`` goes to that context's kernel, one without it to the main kernel.

A ``jupyter`` frame naming a context the agent does not have (stopped, or never started) is
dropped with a log line; a shell or control request gets an error the host's waiting client
sees at once instead of its timeout: an iopub ``error`` and ``status: idle`` (shell only) and a
``*_reply`` of status ``error``, ename ``protocol.CONTEXT_NOT_FOUND``, all with the request as
their parent and the frame's ``context``. The ops refuse such an id with ``ContextNotFound``.

A sandbox has at most ``AgentConfig.max_contexts`` (starting ones count); the agent stops them
all at its own stop, and a ``resumed`` reseeds every one's random streams (``snapshot.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from jupyter_client.kernelspec import KernelSpecManager

from .config import AgentConfig
from .dispatch import Handler
from .kernel import HOST_CHANNELS, Kernel
from .limits import ExecutionMeter
from .relay import Relay
from .shared import log, log_exception, protocol
from .tasks import TaskSet

__all__ = ["Context", "ContextNotFound", "Contexts", "hello_kernels", "installed_kernels"]

Send = Callable[[dict[str, Any]], bool]
SendFrames = Callable[[list[tuple[bytes, memoryview]]], bool]


class ContextNotFound(ValueError):
    """A request named a context this agent does not have."""


def installed_kernels(config: AgentConfig) -> dict[str, str]:
    """The guest's kernelspecs: name -> language (where the agent looks its kernel up)."""
    dirs = config.kernelspec_dirs
    manager = KernelSpecManager() if dirs is None else KernelSpecManager(kernel_dirs=list(dirs))
    specs = manager.get_all_specs()
    return {name: str(info.get("spec", {}).get("language", "")) for name, info in sorted(specs.items())}


def hello_kernels(config: AgentConfig) -> list[dict[str, str]]:
    """What ``hello`` lists: the installed kernelspecs, the main kernel's first (the one a host
    should pick for its language: the others may lack kernelhost's launcher, so their reseed
    after a clone waits for a reply they never send); none if they cannot be read (logged)."""
    try:
        kernels = installed_kernels(config)
    except Exception:  # hello must be answered: a broken kernelspec directory is logged only
        log_exception("cannot list the kernelspecs:")
        return []
    names = sorted(kernels, key=lambda name: name != config.kernel_name)
    return [{"name": name, "language": kernels[name]} for name in names]


@dataclasses.dataclass
class Context:
    """One code context: its kernel, relay and kernel monitor."""

    id: str
    kernel_name: str
    language: str
    cwd: str
    kernel: Kernel
    relay: Relay
    monitor: asyncio.Task[None] | None = None
    #: held by a requested restart and by the stop: a stop waits for a restart in progress
    busy: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    default: bool = False  # its language's default context (the host's mark, kept for it)

    def describe(self) -> dict[str, Any]:
        """What ``context_start`` and ``context_list`` say of it."""
        return {
            "context": self.id,
            "kernel": self.kernel_name,
            "language": self.language,
            "cwd": self.cwd,
            "default": self.default,
        }

    async def close(self) -> None:
        """Stop the monitor first (it would restart the kernel), then the relay and the kernel."""
        if self.monitor is not None:
            self.monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.monitor
        self.relay.stop()
        await self.kernel.stop()


class Contexts:
    """The code contexts of one sandbox, and the routing of the host's jupyter frames."""

    capability = protocol.Capability.CONTEXTS

    def __init__(
        self,
        config: AgentConfig,
        main: Relay,
        send: Send,
        tasks: TaskSet,
        send_frames: SendFrames | None = None,
    ) -> None:
        self.config = config
        self.main = main
        self._send = send
        self._send_frames = send_frames
        self._tasks = tasks
        self._contexts: dict[str, Context] = {}
        self._starting: set[str] = set()  # ids being started (they count against the cap)

    def ops(self) -> Mapping[str, Handler]:
        """context_start, context_stop, context_restart, context_interrupt, context_list."""
        return {
            protocol.Op.CONTEXT_START: self.op_start,
            protocol.Op.CONTEXT_STOP: self.op_stop,
            protocol.Op.CONTEXT_RESTART: self.op_restart,
            protocol.Op.CONTEXT_INTERRUPT: self.op_interrupt,
            protocol.Op.CONTEXT_LIST: self.op_list,
        }

    def frame_handlers(self) -> dict[str, Callable[[dict[str, Any]], None]]:
        """The host's jupyter frames: to the main kernel's relay, or to a context's."""
        return {protocol.Frame.JUPYTER: self.on_jupyter_frame}

    def kernels(self) -> list[Kernel]:
        """The kernels of the contexts started (for ``resumed`` and the network's variables)."""
        return [c.kernel for c in self._contexts.values()]

    # -- ops ---------------------------------------------------------------------------------

    async def op_start(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Start a context's kernel; answered once it is ready."""
        if not self.config.start_kernel:
            raise ValueError("this VM runs no kernel (a template's build VM): no context can start")
        name, language = await self._kernelspec(frame.get("kernel"))
        cwd = self._cwd(frame.get("cwd"))
        cap = self.config.max_contexts
        if len(self._contexts) + len(self._starting) >= cap:
            raise ValueError(
                f"this sandbox has {len(self._contexts) + len(self._starting)} code contexts, its cap "
                f"(max_contexts={cap}); stop one with context_stop before starting another"
            )
        context_id = "ctx-" + secrets.token_hex(6)
        self._starting.add(context_id)
        try:
            await asyncio.to_thread(os.makedirs, cwd, exist_ok=True)
            if self.config.identity.account is not None:
                self.config.identity.account.own(cwd)
            context = await self._launch(context_id, name, language, cwd)
        finally:
            self._starting.discard(context_id)
        context.default = frame.get("default") is True
        self._contexts[context_id] = context
        log(f"context {context_id} started: kernel {name!r}, cwd {cwd!r}")
        return context.describe()

    async def _launch(self, context_id: str, name: str, language: str, cwd: str) -> Context:
        """A kernel process, its relay and monitor; stopped again if it does not get ready."""
        connection_file = self.config.connection_file
        config = dataclasses.replace(
            self.config,
            kernel_name=name,
            language=language,
            kernel_cwd=cwd,
            connection_file=None if connection_file is None else f"{connection_file}.{context_id}",
            standby_kernel=False,
        )
        kernel = Kernel(config, self._send, context=context_id)
        relay = Relay(kernel, ExecutionMeter(kernel.pid), self._send, self._tasks, self._send_frames)
        context = Context(context_id, name, language, cwd, kernel, relay)
        try:
            await kernel.launch()
            relay.start()
            await kernel.wait_ready()
        except BaseException:  # a failed start, or the agent stopping: no process left behind
            await context.close()
            raise
        context.monitor = self._tasks.spawn(kernel.monitor(), name=f"kernel-monitor-{context_id}")
        return context

    async def op_stop(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Shut a context's kernel down and forget the context."""
        context = self._find(frame.get("context"))
        del self._contexts[context.id]  # from now on its frames and ops get ContextNotFound
        acquired = False
        try:  # a restart in progress: its deadlines (ready_timeout, twice at most), then anyway
            async with asyncio.timeout(2 * self.config.ready_timeout):
                acquired = await context.busy.acquire()
        except TimeoutError:
            log(f"context {context.id}: its restart still runs; stopping it anyway")
        try:
            await context.close()
        finally:
            if acquired:
                context.busy.release()
        log(f"context {context.id} stopped")
        return {}

    async def op_restart(self, frame: dict[str, Any]) -> dict[str, Any]:
        """A fresh kernel process for a context (its variables gone, its cwd and kernel kept)."""
        context = self._find(frame.get("context"))
        async with context.busy:  # the restart has its own deadline (ready_timeout)
            await context.kernel.restart(reason="requested")
        return {"kernel_info": context.kernel.kernel_info}

    async def op_interrupt(self, frame: dict[str, Any]) -> dict[str, Any]:
        """SIGINT to a context's kernel: its running cell stops, no other kernel's."""
        await self._find(frame.get("context")).kernel.interrupt()
        return {}

    async def op_list(self, frame: dict[str, Any]) -> dict[str, Any]:
        """The contexts started (not those still starting)."""
        return {"contexts": [c.describe() for c in self._contexts.values()]}

    async def stop(self) -> None:
        """Stop every context (the agent is stopping)."""
        contexts = list(self._contexts.values())
        self._contexts.clear()
        for context in contexts:
            await context.close()

    # -- the host's fields -------------------------------------------------------------------

    def _find(self, context_id: Any) -> Context:
        context = self._contexts.get(context_id) if isinstance(context_id, str) else None
        if context is None:
            raise ContextNotFound(
                f"no code context {context_id!r:.80} in this sandbox (stopped, or never started); "
                "context_list names those running, context_start starts one"
            )
        return context

    async def _kernelspec(self, name: Any) -> tuple[str, str]:
        """The kernelspec's name and language; the main kernel's when ``name`` is None."""
        if name is None:
            return self.config.kernel_name, self.config.language
        if not isinstance(name, str) or not name:
            raise ValueError(f"kernel must be the name of a kernelspec, got {name!r:.80}")
        kernels = await asyncio.to_thread(installed_kernels, self.config)
        if name not in kernels:
            raise ValueError(
                f"no kernelspec {name!r:.80} is installed in this sandbox; installed: "
                f"{', '.join(kernels) or 'none'} (hello lists them under 'kernels')"
            )
        return name, kernels[name] or self.config.language

    def _cwd(self, cwd: Any) -> str:
        """The context's working directory: absolute, the main kernel's when None."""
        if cwd is None:
            return self.config.kernel_cwd
        if not isinstance(cwd, str) or not os.path.isabs(cwd) or "\0" in cwd:
            raise ValueError(
                f"cwd must be an absolute path, got {cwd!r:.200}; e.g. {self.config.kernel_cwd!r}"
            )
        return os.path.normpath(cwd)

    # -- jupyter frames ------------------------------------------------------------------------

    def on_jupyter_frame(self, frame: dict[str, Any]) -> None:
        """A host jupyter frame: no ``context`` (or None) is the main kernel's."""
        context_id = frame.get("context")
        if context_id is None:
            self.main.on_jupyter_frame(frame)
            return
        context = self._contexts.get(context_id) if isinstance(context_id, str) else None
        if context is not None:
            context.relay.on_jupyter_frame(frame)
            return
        channel = frame.get("channel")
        log(f"dropping a {channel!r:.20} jupyter frame for unknown context {context_id!r:.80}")
        msg = frame.get("msg")
        if channel in HOST_CHANNELS and channel != "stdin" and isinstance(msg, dict):
            self._answer_unknown(str(channel), context_id, msg)

    def _answer_unknown(self, channel: str, context_id: Any, msg: dict[str, Any]) -> None:
        """A request to an unknown context gets its error reply (and, on shell, the iopub error
        and idle an execution ends with)."""
        header = msg.get("header")
        msg_type = header.get("msg_type") if isinstance(header, dict) else None
        if not isinstance(msg_type, str) or not msg_type.endswith("_request"):
            return
        parent = dict(header) if isinstance(header, dict) else {}
        session = str(parent.get("session", ""))
        error = {
            "ename": protocol.CONTEXT_NOT_FOUND,
            "evalue": f"no code context {context_id!r:.80} in this sandbox (stopped, or never "
            "started); start one with context_start",
            "traceback": [],
        }
        replies = []
        if channel == "shell":
            replies.append(("iopub", protocol.jupyter_message("error", error, session, parent=parent)))
            idle = {"execution_state": "idle"}
            replies.append(("iopub", protocol.jupyter_message("status", idle, session, parent=parent)))
        reply_type = msg_type[: -len("_request")] + "_reply"
        content: dict[str, Any] = {"status": "error", **error}
        if reply_type == "execute_reply":
            content["execution_count"] = None  # no kernel counted it
        replies.append((channel, protocol.jupyter_message(reply_type, content, session, parent=parent)))
        for reply_channel, reply in replies:
            self._send(
                {"op": protocol.Frame.JUPYTER, "channel": reply_channel, "context": context_id, "msg": reply}
            )
