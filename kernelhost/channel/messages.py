"""What travels on a channel besides requests: Jupyter messages (checked, never trusted), the
agent's description of itself, and the bounded per-request queues they are delivered to."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import ChannelClosed, ProtocolViolation
from .protocol import LEGACY_CAPABILITIES

#: the longest code context id a guest may tag a frame with
CONTEXT_ID_MAX = 64

JUPYTER_CHANNELS = frozenset({"iopub", "shell", "control", "stdin"})


@dataclass(frozen=True)
class JupyterMessage:
    channel: str
    msg: dict[str, Any]
    size: int = 0  # estimated memory it holds: its frame's bytes and decoded objects (codec)
    context: str | None = None  # the code context whose kernel sent it (None: the main kernel)

    @property
    def msg_type(self) -> str:
        return str(self.msg["header"]["msg_type"])

    @property
    def content(self) -> dict[str, Any]:
        return self.msg["content"]  # type: ignore[no-any-return]

    @property
    def parent_id(self) -> str | None:
        msg_id = self.msg["parent_header"].get("msg_id")
        return msg_id if isinstance(msg_id, str) else None


@dataclass(frozen=True)
class AgentInfo:
    """What the agent said of itself in ``hello`` (before it, what protocol 1 had)."""

    version: int = 1
    capabilities: frozenset[str] = field(
        default_factory=lambda: frozenset(str(c) for c in LEGACY_CAPABILITIES)
    )
    kernel_info: dict[str, Any] = field(default_factory=dict)
    boot_id: str = ""
    #: the kernelspecs installed in the guest, (name, language), for code contexts
    kernels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_hello(cls, reply: dict[str, Any]) -> AgentInfo:
        version = reply.get("agent_version")
        version = version if isinstance(version, int) and not isinstance(version, bool) else 1
        caps = reply.get("capabilities")
        if isinstance(caps, list):
            capabilities = frozenset(str(c) for c in caps if isinstance(c, str))
        else:  # protocol 1 announced nothing, and had all of these
            capabilities = frozenset(str(c) for c in LEGACY_CAPABILITIES)
        info = reply.get("kernel_info")
        boot = reply.get("boot_id")
        return cls(
            version,
            capabilities,
            info if isinstance(info, dict) else {},
            boot if isinstance(boot, str) else "",
            _kernels(reply.get("kernels")),
        )


def _kernels(value: Any) -> tuple[tuple[str, str], ...]:
    """hello's ``kernels``, the sane entries of at most 32 (the guest is not trusted)."""
    if not isinstance(value, list):
        return ()
    found: list[tuple[str, str]] = []
    for entry in value[:32]:
        if isinstance(entry, dict):
            name, language = entry.get("name"), entry.get("language")
            if (
                isinstance(name, str)
                and isinstance(language, str)
                and 0 < len(name) <= 64
                and len(language) <= 64
            ):
                found.append((name, language.lower()))
    return tuple(found)


class _Owner(Protocol):
    """What a subscription needs of its channel."""

    @property
    def closed_reason(self) -> str | None: ...

    def _unsubscribe(self, sub: Subscription) -> None: ...


class Subscription:
    """Messages whose parent is one request, in arrival order, with backpressure."""

    def __init__(self, client: _Owner, msg_id: str, maxsize: int, max_bytes: int = 16 * 1024 * 1024) -> None:
        self._client = client
        self.msg_id = msg_id
        self.queue: asyncio.Queue[JupyterMessage | None] = asyncio.Queue(maxsize)
        # Bounded in bytes as well as in messages: a few huge frames must not pile up either.
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False

    async def put(self, message: JupyterMessage) -> None:
        """Queue a message, waiting (backpressure on the channel) while the queue is full."""
        while not self.closed and self.queued_bytes > 0 and self.queued_bytes + message.size > self.max_bytes:
            self._room.clear()
            await self._room.wait()
        if self.closed:
            return
        await self.queue.put(message)
        self.queued_bytes += message.size

    def notify(self, message: JupyterMessage) -> None:
        """Queue a notice of the host's own; never dropped (the oldest output goes instead)."""
        while self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(message)

    async def get(self, timeout: float | None = None) -> JupyterMessage:
        """Next message; raises ChannelClosed if the channel closes, TimeoutError at the deadline."""
        async with asyncio.timeout(timeout):
            item = await self.queue.get()
        if item is None:
            raise ChannelClosed(self._client.closed_reason or "channel closed")
        self.queued_bytes = max(0, self.queued_bytes - item.size)
        self._room.set()
        return item

    def close(self) -> None:
        self.closed = True
        self._client._unsubscribe(self)
        # free space so a reader blocked on put() for this subscription moves on
        while not self.queue.empty():
            self.queue.get_nowait()
        self.queued_bytes = 0
        self._room.set()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_jupyter(frame: dict[str, Any], size: int = 0) -> JupyterMessage:
    channel = frame.get("channel")
    msg = frame.get("msg")
    if not isinstance(channel, str) or channel not in JUPYTER_CHANNELS or not isinstance(msg, dict):
        raise ProtocolViolation(f"malformed jupyter frame on channel {str(channel)[:20]!r}")
    header, parent = msg.get("header"), msg.get("parent_header")
    if not isinstance(header, dict) or not isinstance(header.get("msg_type"), str):
        raise ProtocolViolation("jupyter message without a header or msg_type")
    if not isinstance(parent, dict) or not isinstance(msg.get("content"), dict):
        raise ProtocolViolation("jupyter message without a parent_header or content map")
    if not isinstance(msg.get("metadata", {}), dict):
        raise ProtocolViolation("jupyter message metadata is not a map")
    buffers = msg.get("buffers", [])
    if not isinstance(buffers, list) or not all(isinstance(b, bytes) for b in buffers):
        raise ProtocolViolation("jupyter message buffers are not a list of bytes")
    if parent.get("msg_id") is not None and not isinstance(parent.get("msg_id"), str):
        raise ProtocolViolation("jupyter parent msg_id is not a string")
    context = frame.get("context")
    if context is not None and (not isinstance(context, str) or not 0 < len(context) <= CONTEXT_ID_MAX):
        raise ProtocolViolation(f"jupyter frame's context is not an id: {context!r:.80}")
    return JupyterMessage(str(channel), msg, size, context)
