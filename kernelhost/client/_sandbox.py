"""``AsyncSandbox``: the SDK's primary, asynchronous handle on one sandbox.

The synchronous ``Sandbox`` (``_sync.py``) is derived from this class, so every public method
here is the single source of both surfaces' behaviour and docstrings. Docstrings are therefore
written without ``await``.
"""

from __future__ import annotations

import builtins
import enum
import inspect
import logging
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any

from kernelhost.client._checkpoints import Checkpoint, CheckpointMethods, checkpoint_id
from kernelhost.client._exceptions import (
    KernelHostError,
    NotFoundError,
    TransportError,
    error_for_status,
)
from kernelhost.client._files import AsyncFiles
from kernelhost.client._http import HTTPClient, resolve_config, sandbox_path
from kernelhost.client._metrics import MetricsMethods
from kernelhost.client._models import Execution, ExecutionError, Recovery, Result, SandboxInfo

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are never evaluated at runtime

__all__ = ["AsyncSandbox", "OnError", "OnResult", "OnText"]

#: Default deadline for creating a sandbox: a VM boots, which takes ~15 s on slow hosts.
CREATE_TIMEOUT = 120.0
#: Deadline for a restart: the kernel restarts, or the sandbox gets a fresh VM if it must.
RESTART_TIMEOUT = 300.0
#: Added to run_code's ``timeout`` for the HTTP deadline. The server enforces ``timeout``
#: itself and then may still have to climb its recovery ladder (interrupt grace, kernel restart,
#: a fresh VM) before it sends the final event; this is only a safety net.
EXECUTE_DEADLINE_MARGIN = 240.0

#: Callback types. Each may be a plain function or a coroutine function.
OnText = Callable[[str], object]
OnResult = Callable[[Result], object]
OnError = Callable[[ExecutionError], object]

log = logging.getLogger("kernelhost.client")


class _State(enum.Enum):
    UNOPENED = "unopened"  # constructed; no sandbox exists on the server yet
    OPEN = "open"  # attached to a live sandbox on the server
    CLOSED = "closed"  # deleted (or failed to open); the HTTP session is released
    DETACHED = "detached"  # the handle let go (``detach``); the sandbox runs on, on the server


async def _notify(callback: Callable[[Any], object] | None, value: Any) -> None:
    if callback is None:
        return
    outcome = callback(value)
    if inspect.isawaitable(outcome):
        await outcome


def _not_created() -> KernelHostError:
    return KernelHostError(
        "this sandbox has not been created yet; use `async with AsyncSandbox(...)` "
        "or `await AsyncSandbox.create(...)`"
    )


class AsyncSandbox(CheckpointMethods, MetricsMethods):
    """A sandbox: a VM on a kernelhost server running a Jupyter kernel that keeps its state.

    Create one and close it when done::

        async with AsyncSandbox() as sbx:          # creates on enter, deletes on exit
            execution = await sbx.run_code("1 + 1")
            print(execution.text)                  # "2"

        sbx = await AsyncSandbox.create(template="python", idle_timeout_seconds=300)
        try:
            ...
        finally:
            await sbx.close()

    ``url`` defaults to ``KERNELHOST_URL`` then ``http://127.0.0.1:8999``; ``api_key`` defaults
    to ``KERNELHOST_API_KEY``. Constructing the object only checks this configuration; the
    sandbox is created when the ``async with`` block is entered.
    """

    def __init__(
        self,
        template: str = "python",
        idle_timeout_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = CREATE_TIMEOUT,
        network: str | Mapping[str, Any] | None = None,
        auto_checkpoint: bool | int = False,
        checkpoint: Checkpoint | str | None = None,
    ) -> None:
        if network is not None and not isinstance(network, (str, Mapping)):
            raise TypeError(
                f"network must be 'none', 'allowlist', 'outbound' or a mapping such as "
                f"{{'mode': 'allowlist', 'allow': ['host:443']}}; got {network!r}"
            )
        for key, value in (metadata or {}).items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(
                    f"metadata must map str to str; got {key!r}: {value!r}; convert it with str()"
                )
        self._template = template
        self._idle_timeout_seconds = idle_timeout_seconds
        self._metadata = dict(metadata or {})
        self._network = network if isinstance(network, str) or network is None else dict(network)
        self._auto_checkpoint = auto_checkpoint
        self._checkpoint = checkpoint_id(checkpoint) if checkpoint is not None else None
        self._create_timeout = timeout
        self._http = HTTPClient(resolve_config(url, api_key))
        self._state = _State.UNOPENED
        self._info: SandboxInfo | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        template: str = "python",
        idle_timeout_seconds: int | None = None,
        metadata: Mapping[str, str] | None = None,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = CREATE_TIMEOUT,
        network: str | Mapping[str, Any] | None = None,
        auto_checkpoint: bool | int = False,
        checkpoint: Checkpoint | str | None = None,
    ) -> AsyncSandbox:
        """Create a sandbox on the server and return a handle to it.

        ``template`` names the image to boot; ``idle_timeout_seconds`` lets the server delete the
        sandbox after that long without activity (None: the server's default); ``metadata``
        is stored with the sandbox. ``timeout`` bounds the whole creation, boot included.
        ``network``: ``"none"`` (the default), ``"allowlist"`` (the server's package indexes and
        listed hosts only), ``"outbound"``, or ``{"mode": "allowlist", "allow": ["host:port"]}``
        (docs/network.md). ``auto_checkpoint``: keep the state before each ``run_code`` call so
        that ``undo()`` can rewind it (True: the last 5 calls; an int: that many).
        ``checkpoint``: start the sandbox holding a checkpoint's state instead of a fresh
        template (a branch; ``template`` is then the checkpoint's).
        """
        sbx = cls(
            template=template,
            idle_timeout_seconds=idle_timeout_seconds,
            metadata=metadata,
            url=url,
            api_key=api_key,
            timeout=timeout,
            network=network,
            auto_checkpoint=auto_checkpoint,
            checkpoint=checkpoint,
        )
        await sbx._open()
        return sbx

    @classmethod
    async def connect(
        cls, sandbox_id: str, url: str | None = None, api_key: str | None = None
    ) -> AsyncSandbox:
        """Attach to an existing sandbox by id, checking with the server that it exists.

        Raises ``NotFoundError`` if it does not (or belongs to another API key). Closing the
        returned handle deletes the sandbox.
        """
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise ValueError(f"sandbox_id must be a sandbox's id such as 'sbx_...', got {sandbox_id!r}")
        sbx = cls(url=url, api_key=api_key)
        try:
            sbx._info = SandboxInfo.from_wire(await sbx._http.request("GET", sandbox_path(sandbox_id)))
        except BaseException:
            await sbx._discard()
            raise
        sbx._state = _State.OPEN
        return sbx

    async def _open(self) -> None:
        if self._state is not _State.UNOPENED:
            raise KernelHostError(f"{self!r} was already opened; a sandbox handle opens once")
        body: dict[str, Any] = {"template": self._template, "metadata": self._metadata}
        if self._idle_timeout_seconds is not None:
            body["idle_timeout_seconds"] = self._idle_timeout_seconds
        if self._network is not None:
            body["network"] = self._network
        if self._auto_checkpoint:
            body["auto_checkpoint"] = self._auto_checkpoint
        if self._checkpoint is not None:
            body["checkpoint"] = self._checkpoint
        try:
            created = await self._http.request(
                "POST", "/v1/sandboxes", json_body=body, timeout=self._create_timeout
            )
            self._info = SandboxInfo.from_wire(created)
        except BaseException:
            await self._discard()
            raise
        self._state = _State.OPEN
        if self._info.queued_seconds is not None:  # the key was at a limit: say what it waited for
            log.info(
                "sandbox %s: waited %.1f s for room under this API key's limits "
                "(max_sandboxes_per_key, max_memory_mib_per_key) before it was made",
                self._info.id,
                self._info.queued_seconds,
            )

    async def _discard(self) -> None:
        self._state = _State.CLOSED
        await self._http.aclose()

    async def _release(self) -> None:
        """The handle is gone (collected, or the interpreter exits): close the connection and
        leave the sandbox running, as ``detach`` does."""
        if self._state is _State.OPEN:
            self._state = _State.DETACHED
        await self._http.aclose()

    async def detach(self) -> None:
        """Release this handle's connection but leave the sandbox running on the server.

        ``close()`` deletes the sandbox; ``detach()`` keeps it (with every variable and file)
        until its idle timeout, a delete, or another handle's ``close()``. Reattach later with
        ``connect(id)``; ``id`` stays readable. Any other use of a detached handle raises
        ``KernelHostError``, and a later ``close()`` (an ``async with`` block's exit included)
        does nothing. Safe to call more than once.
        """
        if self._state in (_State.CLOSED, _State.DETACHED):
            return
        self._state = _State.DETACHED
        await self._http.aclose()

    async def close(self) -> None:
        """Delete the sandbox on the server and release the connection.

        Safe to call more than once; a sandbox the server already deleted (404) counts as closed.
        After ``detach()`` it does nothing: the sandbox is no longer this handle's to delete.
        """
        if self._state in (_State.CLOSED, _State.DETACHED):
            return
        try:
            if self._state is _State.OPEN:
                await self._delete()
        finally:
            await self._discard()

    async def _delete(self) -> None:
        try:
            await self._http.request("DELETE", sandbox_path(self.id))
        except NotFoundError:
            pass  # already gone (idle reaper, another client): the goal of close() is met

    async def __aenter__(self) -> Self:
        if self._state is _State.UNOPENED:
            await self._open()
        self._ensure_open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- state -------------------------------------------------------------------------------

    @property
    def id(self) -> str:
        """The sandbox's id, ``sbx_...``."""
        if self._info is None:
            raise _not_created()
        return self._info.id

    def _ensure_open(self) -> None:
        if self._state is _State.DETACHED and self._info is not None:
            raise KernelHostError(
                f"this handle on sandbox {self._info.id} was detached (the sandbox keeps "
                f"running on the server); reattach with connect({self._info.id!r})"
            )
        if self._state in (_State.CLOSED, _State.DETACHED):
            name = self._info.id if self._info else "(never created)"
            raise KernelHostError(f"sandbox {name} is closed; create a new sandbox to run code")
        if self._state is _State.UNOPENED:
            raise _not_created()

    def __repr__(self) -> str:
        name = self._info.id if self._info else "-"
        return f"<{type(self).__name__} {name} {self._state.value} at {self._http.config.url}>"

    # -- operations --------------------------------------------------------------------------

    @property
    def files(self) -> AsyncFiles:
        """The sandbox's files: ``read``, ``read_text``, ``write``, ``list``, ``remove``,
        ``download`` (see ``AsyncFiles``)."""
        return AsyncFiles(self)

    @property
    def queued_seconds(self) -> float | None:
        """Seconds its create waited for room under the key's limits (None: it did not wait)."""
        return self._info.queued_seconds if self._info is not None else None

    async def info(self) -> SandboxInfo:
        """Fetch the sandbox's current record from the server."""
        self._ensure_open()
        queued = self.queued_seconds
        self._info = SandboxInfo.from_wire(await self._http.request("GET", sandbox_path(self.id)))
        self._info.queued_seconds = queued
        return self._info

    async def run_code(
        self,
        code: str,
        language: str = "python",
        timeout: float | None = None,
        on_stdout: OnText | None = None,
        on_stderr: OnText | None = None,
        on_result: OnResult | None = None,
        on_error: OnError | None = None,
        keep_results: bool = True,
    ) -> Execution:
        """Run code in the sandbox's kernel and return everything it produced.

        State persists between calls, as in a notebook. ``language`` is ``"python"`` or
        ``"bash"``. ``timeout`` is how many seconds the server lets the code run before
        stopping it (the execution then has ``status == "timeout"``); None leaves it to the
        server. The client waits up to ``timeout`` plus a margin for the answer, then raises
        ``KernelHostTimeout``.

        A failing cell does not raise: see ``Execution.error`` and ``Execution.status``.

        The ``on_*`` callbacks are called with each output as it arrives, before this method
        returns: ``on_stdout``/``on_stderr`` with the text, ``on_result`` with a ``Result``,
        ``on_error`` with an ``ExecutionError``. They may be plain functions or coroutine
        functions (for ``Sandbox``, they run on its background thread). An exception raised by
        a callback stops reading and propagates out of this call.

        ``keep_results=False`` hands rich results to ``on_result`` only, without keeping them
        in ``Execution.results``: for callers (servers, long-running agents) that keep what
        they need and must not hold every plot of a cell that draws thousands.
        """
        self._ensure_open()
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: use a positive number of seconds, or None")
        deadline = None if timeout is None else timeout + EXECUTE_DEADLINE_MARGIN
        body = {"code": code, "language": language, "timeout": timeout}
        stdout: list[str] = []
        stderr: list[str] = []
        execution = Execution()
        async with self._http.stream(
            "POST", sandbox_path(self.id, "execute"), json_body=body, timeout=deadline
        ) as events:
            async for event in events:
                kind = event.get("type")
                if kind == "stdout":
                    text = str(event.get("text", ""))
                    stdout.append(text)
                    await _notify(on_stdout, text)
                elif kind == "stderr":
                    text = str(event.get("text", ""))
                    stderr.append(text)
                    await _notify(on_stderr, text)
                elif kind in ("result", "update_display"):
                    result = Result.from_wire(event)
                    if keep_results:
                        execution._keep(result)
                    await _notify(on_result, result)
                elif kind == "error":
                    execution.error = ExecutionError.from_wire(event)
                    await _notify(on_error, execution.error)
                elif kind == "failure":  # the service failed after the stream began
                    status = event.get("status")
                    raise error_for_status(
                        status if isinstance(status, int) else 500,
                        {"error": event.get("error")},
                        request=f"POST {sandbox_path(self.id, 'execute')}",
                    )
                elif kind == "end":
                    execution.stdout = "".join(stdout)
                    execution.stderr = "".join(stderr)
                    execution._finish(event)
                    return execution
                # Any other type comes from a newer server: ignored on purpose.
        raise TransportError(
            f"the execution stream of sandbox {self.id} ended early, before its 'end' event "
            f"({len(''.join(stdout))} characters of stdout had arrived); the server may have "
            "restarted or dropped the connection"
        )

    async def interrupt(self) -> bool:
        """Interrupt the running call (like Jupyter's stop button); state is kept.

        Python gets a KeyboardInterrupt, a bash command SIGINT; the call ends with status
        ``"interrupted"``. Does not wait behind the running call. Returns False if nothing ran.
        """
        self._ensure_open()
        reply = await self._http.request("POST", sandbox_path(self.id, "interrupt"))
        return bool(reply.get("interrupted")) if isinstance(reply, dict) else False

    async def restart(self) -> Recovery:
        """Restart the kernel and reset the shell: running code is stopped, variables are lost.

        Files are kept, unless the sandbox's VM was dead or did not answer: then it gets a
        fresh VM from its template. Returns what happened: ``"kernel_restarted"`` or
        ``"vm_replaced"``.
        """
        self._ensure_open()
        reply = await self._http.request("POST", sandbox_path(self.id, "restart"), timeout=RESTART_TIMEOUT)
        recovery = reply.get("recovery") if isinstance(reply, dict) else None
        try:
            return Recovery(str(recovery or Recovery.KERNEL_RESTARTED))
        except ValueError:
            raise TransportError(f"restart answered with an unknown recovery {recovery!r}") from None

    async def fork(self, n: int = 1, timeout: float = CREATE_TIMEOUT) -> builtins.list[AsyncSandbox]:
        """Copy this sandbox, live, into ``n`` new sandboxes (1 to 32).

        Each child starts with every variable, import and file the parent has at this moment;
        afterwards parent and children are independent (a change in one is not seen by the
        others) and each is closed on its own. The parent is paused only while its state is
        copied, then goes on unchanged. Children get fresh random seeds and the current clock.
        """
        self._ensure_open()
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (how many children), got {n!r}")
        payload = await self._http.request(
            "POST", sandbox_path(self.id, "fork"), json_body={"n": n}, timeout=timeout
        )
        items = payload.get("sandboxes") if isinstance(payload, dict) else None
        if not isinstance(items, builtins.list):
            raise TransportError(f"fork answered without a 'sandboxes' list: {payload!r:.300}")
        children = []
        for item in items:
            child = AsyncSandbox.__new__(AsyncSandbox)
            child._template = self._template
            child._idle_timeout_seconds = self._idle_timeout_seconds
            child._metadata = dict(self._metadata)
            child._network = self._network
            child._auto_checkpoint = False
            child._checkpoint = None
            child._create_timeout = self._create_timeout
            child._http = HTTPClient(self._http.config)  # its session opens on first use
            child._info = SandboxInfo.from_wire(item)
            child._state = _State.OPEN
            children.append(child)
        return children

    # Defined last: inside the class body, the name ``list`` refers to this method afterwards.
    @classmethod
    async def list(cls, url: str | None = None, api_key: str | None = None) -> builtins.list[SandboxInfo]:
        """List the sandboxes that belong to the API key."""
        http = HTTPClient(resolve_config(url, api_key))
        try:
            payload = await http.request("GET", "/v1/sandboxes")
        finally:
            await http.aclose()
        items = payload.get("sandboxes") if isinstance(payload, dict) else None
        if not isinstance(items, builtins.list):
            raise TransportError(f"GET /v1/sandboxes answered without a 'sandboxes' list: {payload!r:.300}")
        return [SandboxInfo.from_wire(item) for item in items]
