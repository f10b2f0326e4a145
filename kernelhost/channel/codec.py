"""Sans-IO frame codec for the kernelhost channel.

One module serves both ends: the host service imports it, and the guest image build copies this
file verbatim into the guest, where the agent imports it as ``codec``. It therefore depends on
nothing but the standard library and ``msgpack``.

Wire format: a 4-byte big-endian unsigned length, then that many bytes holding one msgpack map
whose ``"op"`` key is a string. ``FrameDecoder.feed`` checks the declared length against its limit
*before* buffering the body, so a peer cannot make the decoder hold more than
``max_frame_bytes + 4`` bytes, whatever it sends.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "MalformedFrame",
    "encode_frame",
]

DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024
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


class MalformedFrame(FrameError):
    """A frame's body was not a msgpack map with a string ``op``."""


def encode_frame(message: dict[str, Any], max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Serialize one message map into a length-prefixed frame."""
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise MalformedFrame(f"a frame must be a map with a string 'op', got {message!r:.200}")
    body = msgpack.packb(message, use_bin_type=True)
    if len(body) > max_frame_bytes:
        raise FrameTooLarge(len(body), max_frame_bytes)
    return bytes(_HEADER.pack(len(body)) + body)


class FrameDecoder:
    """Incremental decoder: ``feed(bytes) -> list[dict]``.

    After a ``FrameError`` the decoder is poisoned: every later ``feed`` raises again, because the
    stream position can no longer be trusted.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None  # body length of the frame being read, once known
        self._error: FrameError | None = None

    @property
    def buffered(self) -> int:
        """Bytes currently held, never more than ``max_frame_bytes + 4``."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        if self._error is not None:
            raise self._error
        frames: list[dict[str, Any]] = []
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
                    frames.append(_decode_body(bytes(self._buf)))
                    self._buf.clear()
                    self._need = None
        except FrameError as exc:
            self._buf = bytearray()
            self._error = exc
            raise
        return frames


def _decode_body(body: bytes) -> dict[str, Any]:
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise MalformedFrame(f"frame body is not valid msgpack: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise MalformedFrame(f"frame body is not a map with a string 'op': {message!r:.200}")
    return message
