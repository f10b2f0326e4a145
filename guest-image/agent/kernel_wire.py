"""How the kernel and the agent encode the parts of a Jupyter message: msgpack, not JSON.

The kernel's sockets are private to the guest (only the agent connects to them), so their
encoding is the agent's choice. Under emulation ``json.dumps`` of a cell's output ran at about
30 MB/s in the guest and its HMAC at 55: together they capped ``print`` near 10 MB/s. msgpack
copies a string as it is, and the kernelhost kernel runs with an empty key (no signature: nothing
else can reach its sockets that could not already run code in it).

``launch_kernel.py`` makes these the kernel session's ``packer`` and ``unpacker``; the agent
unpacks with ``unpack`` whatever its kernel is, since it reads JSON too (another kernel, or a
message msgpack could not carry, such as an integer over 64 bits, which ``pack`` sends as JSON).

A ``stream`` message's content (``{"name": "stdout" or "stderr", "text": <str>}``, most of what a
cell prints) is packed in one of two layouts, which the agent's relay reads
(``kernelhost_agent.streamwire``): ``name`` first, as msgpack packs the dict; or, when the text is
ASCII (``str.isascii`` knows it without a scan), ``text`` first, with its characters copied once
from the str into the packed buffer instead of twice (msgpack's buffer, then its bytes): a copy of
a print's worth of output costs about 60 ms per 32 MiB under emulation. Text first is this
packer's promise that the text is ASCII, so a stream dict that is not packed that way is packed
name first, whatever order its keys came in.
"""

from __future__ import annotations

import base64
import datetime
import json
import numbers
import struct
import sys
from typing import Any

import msgpack

__all__ = ["ASCII_HEAD", "STREAM_TAILS", "pack", "unpack"]

_JSON_START = (b"{", b"[", b'"')
_STREAM_KEYS = {"name", "text"}
#: what follows the text in the ASCII layout, per stream name (the agent's relay reads it too)
STREAM_TAILS = {"stdout": b"\xa4name\xa6stdout", "stderr": b"\xa4name\xa6stderr"}
ASCII_HEAD = b"\x82\xa4text\xdb"  # a map of two, "text", then a str32 header: the ASCII layout
ASCII_AT_LEAST = 4096  # characters: below that, msgpack's two copies cost less than the calls
_U32 = struct.Struct(">I")


def _chars_at() -> int | None:
    """Where a compact ASCII str's characters start in the str object (CPython), checked on a
    probe; None where that cannot be done (then every stream is packed name first)."""
    try:
        import ctypes
    except ImportError:
        return None
    probe = "kernelhost" * 8
    at = sys.getsizeof("") - 1  # the object's head; its one character is the terminating NUL
    if sys.implementation.name != "cpython" or ctypes.string_at(id(probe) + at, len(probe)) != probe.encode():
        return None
    return at


_CHARS_AT = _chars_at()


def _default(obj: Any) -> Any:
    """What jupyter_client's JSON packer would make of a value JSON cannot hold."""
    if isinstance(obj, datetime.datetime):
        if obj.tzinfo is None:
            obj = obj.replace(tzinfo=datetime.UTC)
        return obj.isoformat().replace("+00:00", "Z")
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not msgpack data")


def pack(obj: Any) -> bytes | bytearray:
    """One part of a message; JSON (as jupyter_client writes it) if msgpack cannot hold it."""
    if type(obj) is dict and obj.keys() == _STREAM_KEYS:
        return _pack_stream(obj)
    return _pack(obj)


def _pack(obj: Any) -> bytes:
    try:
        data: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
        return data
    except (TypeError, ValueError, OverflowError):
        from jupyter_client.session import json_packer

        return bytes(json_packer(obj))


def _pack_stream(content: dict[str, Any]) -> bytes | bytearray:
    """A stream message's content: text first if its text is ASCII (one copy), else name first."""
    name, text = content["name"], content["text"]
    tail = STREAM_TAILS.get(name) if type(name) is str else None
    if (
        tail is None
        or type(text) is not str
        or len(text) < ASCII_AT_LEAST
        or not text.isascii()
        or _CHARS_AT is None
        or sys.getsizeof(text) != _CHARS_AT + len(text) + 1  # its characters inline: compact
    ):
        return _pack({"name": name, "text": text})
    import ctypes

    size = len(text)
    out = bytearray(len(ASCII_HEAD) + 4 + size + len(tail))
    out[: len(ASCII_HEAD)] = ASCII_HEAD
    at = len(ASCII_HEAD) + 4
    _U32.pack_into(out, len(ASCII_HEAD), size)
    view = (ctypes.c_char * size).from_buffer(out, at)
    ctypes.memmove(view, id(text) + _CHARS_AT, size)  # ``text`` is alive: this frame holds it
    del view  # the export of ``out`` ends here
    out[at + size :] = tail
    return out


def unpack(raw: bytes | bytearray) -> Any:
    """One part of a message, msgpack or JSON: JSON data either way (bytes in base64, as the
    JSON packer would have sent them)."""
    data = bytes(raw)
    if data[:1] in _JSON_START:
        return json.loads(data)
    return _jsonable(msgpack.unpackb(data, raw=False, strict_map_key=False))


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if not all(type(k) is str for k in value):  # as JSON writes them: 1 -> "1", None -> "null"
            value = {k if isinstance(k, str) else json.dumps(k): v for k, v in value.items()}
        for k, v in value.items():
            if isinstance(v, (dict, list, bytes)):
                value[k] = _jsonable(v)
        return value
    if isinstance(value, list):
        return [_jsonable(v) if isinstance(v, (dict, list, bytes)) else v for v in value]
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii") + "\n"  # b2a_base64's newline, as JSON's
    return value
