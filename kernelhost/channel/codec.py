"""Sans-IO frame codec for the kernelhost channel.

One module serves both ends: the host service imports it, and the guest image build copies this
file verbatim into the guest, where the agent imports it as ``codec``. It therefore depends on
nothing but the standard library and ``msgpack``.

Wire format: a 4-byte big-endian unsigned length, then that many bytes holding one msgpack map
whose ``"op"`` key is a string. ``FrameDecoder.feed`` checks the declared length against its limit
*before* buffering the body, so a peer cannot make the decoder hold more than
``max_frame_bytes + 4`` bytes, whatever it sends.

A frame is also bounded in structure: at most ``max_objects`` maps, arrays and entries of them
(each entry of a map counts its key and value), and no container over ``MAX_CONTAINER_LEN``
entries. Without that bound a frame of one-byte empty maps decodes to dozens of times its size;
with it, what a frame costs in memory stays near its length (``FrameDecoder`` reports each
frame's estimated cost). Both ends check both bounds: a sender never sends what the receiver
would refuse.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_CONTAINER_LEN",
    "MAX_FRAME_OBJECTS",
    "FrameDecoder",
    "FrameError",
    "FrameHead",
    "FrameTooComplex",
    "FrameTooLarge",
    "MalformedFrame",
    "encode_frame",
]

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_FRAME_OBJECTS = 1_000_000
MAX_CONTAINER_LEN = 1_000_000
#: estimated bytes of memory per decoded object, for the cost of a frame
OBJECT_COST = 64
_HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The byte stream broke the framing protocol; the connection must be dropped."""


class FrameTooLarge(FrameError):
    """A frame declared a length over the decoder's limit."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(
            f"frame of {length} bytes exceeds the limit of {limit} bytes; "
            "raise max_frame_bytes on both ends or send smaller frames"
        )
        self.length = length
        self.limit = limit


class FrameTooComplex(FrameError):
    """A frame holds more maps, arrays and entries than a frame may."""


class MalformedFrame(FrameError):
    """A frame's body was not a msgpack map with a string ``op``."""


def count_objects(message: Any, limit: int) -> int:
    """How many maps, arrays and entries ``message`` holds (as the decoder counts them);
    ``FrameTooComplex`` as soon as that passes ``limit``."""
    count = 0
    stack = [message]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += 1 + 2 * len(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            count += 1 + len(item)
            stack.extend(item)
        else:
            continue
        if count > limit:
            raise FrameTooComplex(f"a frame may hold {limit} maps, arrays and entries; this one more")
    return count


def encode_frame(
    message: dict[str, Any],
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    max_objects: int = MAX_FRAME_OBJECTS,
) -> bytes:
    """Serialize one message map into a length-prefixed frame."""
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise MalformedFrame(f"a frame must be a map with a string 'op', got {message!r:.200}")
    count_objects(message, max_objects)
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame_bytes:
        raise FrameTooLarge(len(body), max_frame_bytes)
    return bytes(_HEADER.pack(len(body)) + body)


class FrameHead:
    """The start of frames whose last entry ``key`` is a bin of bytes that the caller writes
    right after the head (from a pipe, say, without copying them through here). ``message`` is
    packed once; ``head(size)`` is the length prefix and the map up to the bin's header.

    The frame is ``message`` with ``key`` added last, so the receiver decodes it as any other;
    the bin's header is always the 4-byte-length form (0xc6), which msgpack reads for any size.
    """

    def __init__(
        self, message: dict[str, Any], key: str, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        if not isinstance(message, dict) or not isinstance(message.get("op"), str) or key in message:
            raise MalformedFrame(
                f"a frame head needs a map with a string 'op' and no {key!r}: {message!r:.200}"
            )
        count_objects(message, MAX_FRAME_OBJECTS)
        packer = msgpack.Packer(use_bin_type=True)
        parts = [packer.pack_map_header(len(message) + 1)]
        for name, value in message.items():
            parts.append(packer.pack(name))
            parts.append(packer.pack(value))
        parts.append(packer.pack(key))
        self._body = b"".join(parts) + b"\xc6"
        self.max_frame_bytes = max_frame_bytes

    def head(self, size: int) -> bytes:
        """The head of the frame whose bin holds ``size`` bytes."""
        length = len(self._body) + _HEADER.size + size
        if size < 0 or length > self.max_frame_bytes:
            raise FrameTooLarge(length, self.max_frame_bytes)
        return _HEADER.pack(length) + self._body + _HEADER.pack(size)


class FrameDecoder:
    """Incremental decoder: ``feed(bytes) -> list[dict]`` (``feed_costed`` also gives each
    frame's estimated cost in bytes of memory).

    After a ``FrameError`` the decoder is poisoned: every later ``feed`` raises again, because the
    stream position can no longer be trusted.
    """

    def __init__(
        self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, max_objects: int = MAX_FRAME_OBJECTS
    ) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self.max_objects = max_objects
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once known
        self._error: str | None = None  # why the decoder stopped (a message, not the exception)

    @property
    def buffered(self) -> int:
        """Bytes currently held, never more than ``max_frame_bytes + 4``."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        return [frame for frame, _ in self.feed_costed(data)]

    def feed_costed(self, data: bytes) -> list[tuple[dict[str, Any], int]]:
        if self._error is not None:
            raise MalformedFrame(f"the channel stopped at an earlier bad frame: {self._error}")
        frames: list[tuple[dict[str, Any], int]] = []
        view = memoryview(data)
        try:
            while view:
                if self._need is None:
                    take = min(_HEADER.size - len(self._buf), len(view))
                    self._buf += view[:take]
                    view = view[take:]
                    if len(self._buf) < _HEADER.size:
                        break
                    (length,) = _HEADER.unpack(self._buf)
                    self._buf.clear()
                    if length > self.max_frame_bytes:
                        raise FrameTooLarge(length, self.max_frame_bytes)
                    self._need = length
                take = min(self._need - len(self._buf), len(view))
                self._buf += view[:take]
                view = view[take:]
                if len(self._buf) == self._need:
                    # msgpack copies what it keeps, so the buffer is decoded in place, not copied
                    frames.append(_decode_body(self._buf, self.max_objects))
                    self._buf.clear()
                    self._need = None
        except FrameError as exc:
            # keep only the message: the exception's traceback holds the frame being decoded
            # (a guest's object bomb, tens of MiB), and the caller's frame holds this decoder
            self._buf = bytearray()
            self._error = str(exc)
            raise
        return frames


class _Budget:
    """Counts containers and their entries while msgpack builds them; stops past the limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.count = 0

    def map(self, obj: dict[Any, Any]) -> dict[Any, Any]:
        self.count += 1 + 2 * len(obj)
        if self.count > self.limit:
            raise FrameTooComplex(f"a frame may hold {self.limit} maps, arrays and entries")
        return obj

    def array(self, obj: list[Any]) -> list[Any]:
        self.count += 1 + len(obj)
        if self.count > self.limit:
            raise FrameTooComplex(f"a frame may hold {self.limit} maps, arrays and entries")
        return obj


def _decode_body(body: bytes | bytearray, max_objects: int) -> tuple[dict[str, Any], int]:
    budget = _Budget(max_objects)
    try:
        message = msgpack.unpackb(
            body,
            raw=False,
            strict_map_key=False,
            object_hook=budget.map,
            list_hook=budget.array,
            max_array_len=MAX_CONTAINER_LEN,
            max_map_len=MAX_CONTAINER_LEN,
        )
    except FrameTooComplex:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise MalformedFrame(f"frame body is not valid msgpack: {str(exc)[:200]}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise MalformedFrame(f"frame body is not a map with a string 'op': {message!r:.200}")
    return message, len(body) + OBJECT_COST * budget.count
