"""A kernel's ``stream`` message relayed with its text as the kernel packed it (sans-IO).

Most of what a cell prints is the ``text`` of iopub ``stream`` messages, and the kernel packs
their content in msgpack (``kernel_wire.pack``): ``{"name": "stdout", "text": <str>}``. Decoding
that text into a Python string, cutting it into pieces and packing it again costs three passes
over every byte, each slow under emulation. When the text is ASCII (valid UTF-8 of as many
characters as bytes, so its size and its cuts are plain byte counts) the relay takes its bytes as
they came from the kernel's socket and writes them after a frame head it packs itself
(``frame_parts``): the host decodes the same frame it would have got from the slow path
(``relay.parse`` and ``relay.split_stream``), keys in another order. The kernel's packer puts
``text`` first only when it found the text ASCII, so such a text is written from the socket's
buffer itself; ``name`` first, it is copied out once to be checked. Anything else (another
layout, non-ASCII text, JSON from another kernel) returns None and takes the slow path.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
from kernel_wire import ASCII_HEAD as ASCII_HEAD  # the layouts the kernel packs (beside the agent)
from kernel_wire import STREAM_TAILS

from .shared import codec, protocol

__all__ = ["RawStream", "frame_parts", "raw_stream"]

_NAMES = {b"stdout": "stdout", b"stderr": "stderr"}
_TAILS = {tail: name for name, tail in STREAM_TAILS.items()}  # what follows a text-first text
_TAIL_SIZE = len(STREAM_TAILS["stdout"])
_U16, _U32 = struct.Struct(">H"), struct.Struct(">I")


class RawStream:
    """The name and the raw ASCII text of a stream message's content (bytes, or a view of the
    kernel's frame, which it keeps alive)."""

    __slots__ = ("name", "text")

    def __init__(self, name: str, text: bytes | memoryview) -> None:
        self.name = name
        self.text = text


def raw_stream(content: memoryview) -> RawStream | None:
    """The content part of a stream message (the buffer of the kernel's zmq frame), if it is
    exactly msgpack ``{"name": "stdout" or "stderr", "text": <ASCII str>}``: text first (the
    packer's ASCII layout), a view of its text; name first, its text copied out once and checked.
    None for anything else."""
    head = bytes(content[:32])  # the keys, the name and the text's str header, if this is one
    if head.startswith(ASCII_HEAD):
        return _ascii_layout(content, head)
    if head[:6] != b"\x82\xa4name" or len(head) < 7:
        return None
    size = head[6] - 0xA0
    name = _NAMES.get(head[7 : 7 + size]) if 0 <= size < 32 else None
    at = 7 + size
    if name is None or head[at : at + 5] != b"\xa4text":
        return None
    length = _str_length(head, at + 5)
    if length is None or length[0] + length[1] != len(content):
        return None
    text = content[length[0] :].tobytes()
    return RawStream(name, text) if text.isascii() else None


def _ascii_layout(content: memoryview, head: bytes) -> RawStream | None:
    """``{"text": <str32>, "name": ...}`` as ``kernel_wire.pack`` writes an ASCII text."""
    length = _str_length(head, len(ASCII_HEAD) - 1)
    if length is None:
        return None
    start, size = length
    if len(content) - start - size != _TAIL_SIZE:
        return None
    name = _TAILS.get(bytes(content[start + size :]))
    return None if name is None else RawStream(name, content[start : start + size])


def _str_length(data: bytes, at: int) -> tuple[int, int] | None:
    """Where a msgpack str at ``at`` starts its bytes, and how many; None if not a str."""
    if at >= len(data):
        return None
    tag = data[at]
    if 0xA0 <= tag <= 0xBF:
        return at + 1, tag & 0x1F
    if tag == 0xD9 and at + 2 <= len(data):
        return at + 2, data[at + 1]
    if tag == 0xDA and at + 3 <= len(data):
        return at + 3, _U16.unpack_from(data, at + 1)[0]
    if tag == 0xDB and at + 5 <= len(data):
        return at + 5, _U32.unpack_from(data, at + 1)[0]
    return None


def frame_parts(
    channel: str,
    header: dict[str, Any],
    parent: dict[str, Any],
    metadata: dict[str, Any],
    stream: RawStream,
    piece: int,
    max_frame_bytes: int,
    context: str | None = None,
) -> list[tuple[bytes, memoryview]]:
    """The frames of ``stream``: for each piece of at most ``piece`` bytes of its text, the
    frame's head (length prefix, then the map up to the text's str header) and the piece. Pieces
    after the first get msg_ids of their own, as ``relay.split_stream`` gives them. With
    ``context`` (a code context's kernel), the frames carry it.
    ``codec.FrameTooLarge`` if a frame would pass ``max_frame_bytes``."""
    packer = msgpack.Packer(use_bin_type=True)
    msg_id = str(header.get("msg_id", ""))
    frames = []
    text = memoryview(stream.text)
    tag = b"" if context is None else packer.pack("context") + packer.pack(context)
    for i, start in enumerate(range(0, max(len(text), 1), piece)):
        chunk = text[start : start + piece]
        head = b"".join(
            (
                packer.pack_map_header(3 if context is None else 4),
                packer.pack("op"),
                packer.pack(str(protocol.Frame.JUPYTER.value)),
                packer.pack("channel"),
                packer.pack(channel),
                tag,
                packer.pack("msg"),
                packer.pack_map_header(5),
                packer.pack("header"),
                packer.pack(header if i == 0 else {**header, "msg_id": f"{msg_id}-{i}"}),
                packer.pack("parent_header"),
                packer.pack(parent),
                packer.pack("metadata"),
                packer.pack(metadata),
                packer.pack("buffers"),
                packer.pack([]),
                packer.pack("content"),
                packer.pack_map_header(2),
                packer.pack("name"),
                packer.pack(stream.name),
                packer.pack("text"),
                b"\xdb" + _U32.pack(len(chunk)),
            )
        )
        length = len(head) + len(chunk)
        if length > max_frame_bytes:
            raise codec.FrameTooLarge(length, max_frame_bytes)
        frames.append((_U32.pack(length) + head, chunk))
    return frames
