"""How the kernel and the agent encode the parts of a Jupyter message: msgpack, not JSON.

The kernel's sockets are private to the guest (only the agent connects to them), so their
encoding is the agent's choice. Under emulation ``json.dumps`` of a cell's output ran at about
30 MB/s in the guest and its HMAC at 55: together they capped ``print`` near 10 MB/s. msgpack
copies a string as it is, and the kernelhost kernel runs with an empty key (no signature: nothing
else can reach its sockets that could not already run code in it).

``launch_kernel.py`` makes these the kernel session's ``packer`` and ``unpacker``; the agent
unpacks with ``unpack`` whatever its kernel is, since it reads JSON too (another kernel, or a
message msgpack could not carry, such as an integer over 64 bits, which ``pack`` sends as JSON).
"""

from __future__ import annotations

import base64
import datetime
import json
import numbers
from typing import Any

import msgpack

__all__ = ["pack", "unpack"]

_JSON_START = (b"{", b"[", b'"')


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


def pack(obj: Any) -> bytes:
    """One part of a message; JSON (as jupyter_client writes it) if msgpack cannot hold it."""
    try:
        data: bytes = msgpack.packb(obj, default=_default, use_bin_type=True)
        return data
    except (TypeError, ValueError, OverflowError):
        from jupyter_client.session import json_packer

        return bytes(json_packer(obj))


def unpack(raw: bytes) -> Any:
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
