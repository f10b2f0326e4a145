"""``Sandbox``: the synchronous twin of ``AsyncSandbox``, derived from it rather than copied.

Each ``Sandbox`` owns a private event loop running in a daemon thread (a ``_LoopThread``), and
wraps an ``AsyncSandbox`` that lives on that loop. Methods submit the ``AsyncSandbox`` coroutine
to the loop with ``asyncio.run_coroutine_threadsafe`` and block on the result, so behaviour,
signatures and docstrings come from ``AsyncSandbox`` (``functools.wraps``). Because the loop is
private, ``Sandbox`` also works where an event loop is already running (e.g. a notebook).

The thread is stopped when the sandbox is closed, and when construction fails. A handle that
is garbage-collected, or still open when the interpreter exits (a script or notebook that
leaves its sandbox to its idle timeout), lets go of its connection quietly, as ``detach()``
would: the sandbox keeps running on the server.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from kernelhost.client._checkpoints import Checkpoint
from kernelhost.client._exceptions import KernelHostError
from kernelhost.client._files import AsyncFiles
from kernelhost.client._models import SandboxInfo
from kernelhost.client._sandbox import CREATE_TIMEOUT, AsyncSandbox
from kernelhost.client._templates import AsyncTemplate

if TYPE_CHECKING:
    from typing import Self  # Python 3.11+; annotations are never evaluated at runtime

__all__ = ["Sandbox", "Template"]

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")

#: How long stopping the loop thread may take (pending tasks are cancelled first).
_STOP_TIMEOUT = 10.0


class _LoopThread:
    """A private asyncio event loop running in a daemon thread."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kernelhost-sandbox", daemon=True)
        self._lock = threading.Lock()
        self._stopped = False
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stopped

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.run_until_complete(self._drain())
            self._loop.close()

    async def _drain(self) -> None:
        # Anything still running (a run_code abandoned by Ctrl-C, say) is cancelled and given
        # a bounded time to run its cleanup, so its HTTP connection is closed properly.
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=_STOP_TIMEOUT / 2)
        await self._loop.shutdown_asyncgens()

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and block until it finishes; return its result."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise KernelHostError(
                "a Sandbox method was called from inside one of its own callbacks, which would "
                "deadlock; collect what you need in the callback and act after run_code returns"
            )
        if self._stopped:
            coro.close()
            raise KernelHostError("this Sandbox's event loop is stopped; the sandbox is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # No deadline here on purpose: every coroutine of AsyncSandbox carries its own.
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: stop the request instead of leaking it
            raise

    def release(self, sbx: AsyncSandbox) -> None:
        """Let go of ``sbx``'s connection and stop, for a handle nobody holds any more."""
        if self._stopped:
            return
        if threading.current_thread() is self._thread:  # collected on the loop itself
            self._loop.create_task(sbx._release())
            self._stopped = True
            self._loop.call_soon(self._loop.stop)
            return
        with contextlib.suppress(Exception):  # at exit or in a collector: never raise there
            self.call(_within(_STOP_TIMEOUT / 2, sbx._release()))
        self.stop()

    def stop(self) -> None:
        """Stop the loop and join the thread; safe to call more than once."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        if threading.current_thread() is self._thread:
            raise KernelHostError("a Sandbox cannot be closed from inside one of its callbacks")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(_STOP_TIMEOUT)


def _sync_method(
    method: Callable[Concatenate[AsyncSandbox, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Sandbox, P], R]:
    """Derive a blocking ``Sandbox`` method from an ``AsyncSandbox`` coroutine method."""

    @functools.wraps(method)
    def blocking(self: Sandbox, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._call(method(self._async, *args, **kwargs))

    blocking.__qualname__ = f"Sandbox.{method.__name__}"
    return blocking


def _sync_files_method(
    method: Callable[Concatenate[AsyncFiles, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[Files, P], R]:
    """Derive a blocking ``Files`` method from an ``AsyncFiles`` coroutine method."""

    @functools.wraps(method)
    def blocking(self: Files, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._sandbox._call(method(self._sandbox._async.files, *args, **kwargs))

    blocking.__qualname__ = f"Files.{method.__name__}"
    return blocking


class Files:
    """The files of a ``Sandbox``: the blocking twin of ``AsyncFiles`` (``sandbox.files``)."""

    __doc__ = (__doc__ or "") + "\n\n" + (AsyncFiles.__doc__ or "")

    def __init__(self, sandbox: Sandbox) -> None:
        self._sandbox = sandbox

    write = _sync_files_method(AsyncFiles.write)
    read = _sync_files_method(AsyncFiles.read)
    read_text = _sync_files_method(AsyncFiles.read_text)
    download = _sync_files_method(AsyncFiles.download)
    remove = _sync_files_method(AsyncFiles.remove)
    # Defined last: inside the class body, the name ``list`` refers to this method afterwards.
    list = _sync_files_method(AsyncFiles.list)


def _doc_from(source: Callable[..., Any]) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Give a hand-written ``Sandbox`` method the docstring of its ``AsyncSandbox`` original."""

    def apply(target: Callable[P, R]) -> Callable[P, R]:
        target.__doc__ = source.__doc__
        return target

    return apply


class Sandbox:
    """A sandbox, for synchronous code: the blocking twin of ``AsyncSandbox``.

    The constructor creates the sandbox on the server (it blocks while the VM boots)::

        with Sandbox() as sbx:                    # deleted when the block exits
            execution = sbx.run_code("print('hi')", on_stdout=print)

    ``url`` defaults to ``KERNELHOST_URL`` then ``http://127.0.0.1:8999``; ``api_key`` defaults
    to ``KERNELHOST_API_KEY``. Callbacks passed to ``run_code`` are called on the sandbox's
    background thread, and must not call this sandbox's methods.
    """

    _async: AsyncSandbox
    _loop_thread: _LoopThread

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
        # Configuration errors (no API key, bad URL) surface here, before a thread exists.
        sbx = AsyncSandbox(
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
        loop_thread = _LoopThread()
        try:
            loop_thread.call(sbx._open())
        except BaseException:
            loop_thread.stop()
            raise
        self._async = sbx
        self._loop_thread = loop_thread
        weakref.finalize(self, loop_thread.release, sbx)

    @classmethod
    def _adopt(cls, sbx: AsyncSandbox, loop_thread: _LoopThread) -> Sandbox:
        self = cls.__new__(cls)
        self._async = sbx
        self._loop_thread = loop_thread
        weakref.finalize(self, loop_thread.release, sbx)
        return self

    @classmethod
    @_doc_from(AsyncSandbox.connect)
    def connect(cls, sandbox_id: str, url: str | None = None, api_key: str | None = None) -> Sandbox:
        loop_thread = _LoopThread()
        try:
            sbx = loop_thread.call(AsyncSandbox.connect(sandbox_id, url=url, api_key=api_key))
        except BaseException:
            loop_thread.stop()
            raise
        return cls._adopt(sbx, loop_thread)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop_thread.stopped:
            coro.close()
            self._async._ensure_open()  # raises "sandbox sbx_... is closed"
        return self._loop_thread.call(coro)

    @property
    def id(self) -> str:
        """The sandbox's id, ``sbx_...``."""
        return self._async.id

    @property
    def files(self) -> Files:
        """The sandbox's files: ``read``, ``read_text``, ``write``, ``list``, ``remove``,
        ``download``."""
        return Files(self)

    @property
    def queued_seconds(self) -> float | None:
        """Seconds its create waited for room under the key's limits (None: it did not wait)."""
        return self._async.queued_seconds

    info = _sync_method(AsyncSandbox.info)
    run_code = _sync_method(AsyncSandbox.run_code)
    interrupt = _sync_method(AsyncSandbox.interrupt)
    restart = _sync_method(AsyncSandbox.restart)
    checkpoint = _sync_method(AsyncSandbox.checkpoint)
    checkpoints = _sync_method(AsyncSandbox.checkpoints)
    delete_checkpoint = _sync_method(AsyncSandbox.delete_checkpoint)
    restore = _sync_method(AsyncSandbox.restore)
    undo = _sync_method(AsyncSandbox.undo)
    get_metrics = _sync_method(AsyncSandbox.get_metrics)

    @_doc_from(AsyncSandbox.fork)
    def fork(self, n: int = 1, timeout: float = CREATE_TIMEOUT) -> builtins.list[Sandbox]:
        children = self._call(self._async.fork(n, timeout=timeout))
        # each child gets its own loop thread: closing one must not stop another
        return [Sandbox._adopt(child, _LoopThread()) for child in children]

    @_doc_from(AsyncSandbox.close)
    def close(self) -> None:
        if self._loop_thread.stopped:
            return
        try:
            self._loop_thread.call(self._async.close())
        finally:
            self._loop_thread.stop()

    @_doc_from(AsyncSandbox.detach)
    def detach(self) -> None:
        if self._loop_thread.stopped:
            return
        try:
            self._loop_thread.call(self._async.detach())
        finally:
            self._loop_thread.stop()

    def __enter__(self) -> Self:
        self._async._ensure_open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return repr(self._async).replace("AsyncSandbox", "Sandbox", 1)

    # Defined last: inside the class body, the name ``list`` refers to this method afterwards.
    @classmethod
    @_doc_from(AsyncSandbox.list)
    def list(cls, url: str | None = None, api_key: str | None = None) -> builtins.list[SandboxInfo]:
        loop_thread = _LoopThread()
        try:
            return loop_thread.call(AsyncSandbox.list(url=url, api_key=api_key))
        finally:
            loop_thread.stop()


def _sync_classmethod(
    method: Callable[P, Coroutine[Any, Any, R]],
) -> Callable[P, R]:
    """Derive a blocking class method from an ``AsyncTemplate`` coroutine class method: each
    call runs on a private loop thread (callbacks are called on it)."""

    @functools.wraps(method)
    def blocking(*args: P.args, **kwargs: P.kwargs) -> R:
        loop_thread = _LoopThread()
        try:
            return loop_thread.call(method(*args, **kwargs))
        finally:
            loop_thread.stop()

    return blocking


async def _collect(items: AsyncIterator[T]) -> builtins.list[T]:
    return [item async for item in items]


class Template:
    """Templates, for synchronous code: the blocking twin of ``AsyncTemplate``.

    info = Template.build("ml.toml", on_stage=lambda stage, detail: print(stage, detail))
    with Sandbox(template=info.name) as sbx: ...
    """

    __doc__ = (__doc__ or "") + "\n\n" + (AsyncTemplate.__doc__ or "")

    build = staticmethod(_sync_classmethod(AsyncTemplate.build))
    wait = staticmethod(_sync_classmethod(AsyncTemplate.wait))
    get = staticmethod(_sync_classmethod(AsyncTemplate.get))
    delete = staticmethod(_sync_classmethod(AsyncTemplate.delete))
    cancel = staticmethod(_sync_classmethod(AsyncTemplate.cancel))

    @staticmethod
    @_doc_from(AsyncTemplate.logs)
    def logs(name: str, build_id: str | None = None, **kwargs: Any) -> builtins.list[dict[str, Any]]:
        loop_thread = _LoopThread()
        try:
            return loop_thread.call(_collect(AsyncTemplate.logs(name, build_id, **kwargs)))
        finally:
            loop_thread.stop()

    # Defined last: inside the class body, the name ``list`` refers to this method afterwards.
    list = staticmethod(_sync_classmethod(AsyncTemplate.list))


async def _within(seconds: float, aw: Coroutine[Any, Any, R]) -> R:
    """``aw`` with a deadline (``asyncio.timeout``: ``wait_for`` before Python 3.12 can lose a
    cancellation that comes as ``aw`` ends)."""
    async with asyncio.timeout(seconds):
        return await aw
