"""The Kernel Gateway's WebSocket framings of a Jupyter message (sans-IO, no dependencies).

A message here is a dict ``{"header", "parent_header", "metadata", "content", "buffers"}`` plus
the channel it travels on. Three framings exist (contracts.md 5a):

- legacy text: one JSON object with ``channel`` and the four dicts (buffers cannot travel; this
  is the only framing jupyter_server's GatewayClient speaks, so buffers never cross that hop);
- legacy binary (inbound only here): ``u32 BE nbufs``, ``nbufs`` u32 BE offsets, the JSON
  message, then the raw buffers;
- ``v1.kernel.websocket.jupyter.org``: ``u64 LE`` count of offsets, the offsets (u64 LE, from the
  frame start), then the channel name, the four dicts as JSON and the raw buffers.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from itertools import pairwise
from typing import Any

V1_PROTOCOL = "v1.kernel.websocket.jupyter.org"
CHANNELS = ("shell", "iopub", "stdin", "control")
PARTS = ("header", "parent_header", "metadata", "content")
#: offsets a v1 frame may declare (channel + 4 dicts + buffers); more is not a Jupyter message
MAX_V1_OFFSETS = 4096


class WireError(ValueError):
    """A WebSocket frame that is not a Jupyter message; the text says what is wrong."""


def dumps(value: Any) -> str:
    """JSON for a Jupyter client: bytes as base64, other odd values as text, no NaN tokens."""
    try:
        return json.dumps(value, default=_default, allow_nan=False, separators=(",", ":"))
    except ValueError:  # NaN or infinity from a guest: JSON has no such numbers
        return json.dumps(_finite(value), default=_default, allow_nan=False, separators=(",", ":"))


def _default(value: Any) -> Any:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    return str(value)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


# -- outbound ---------------------------------------------------------------------------------


def to_text(channel: str, msg: dict[str, Any]) -> str:
    """The legacy text frame; buffers are dropped (the framing has no room for them)."""
    header = msg.get("header") or {}
    return dumps(
        {
            "channel": channel,
            "header": header,
            "parent_header": msg.get("parent_header") or {},
            "metadata": msg.get("metadata") or {},
            "content": msg.get("content") or {},
            "buffers": [],
            "msg_id": header.get("msg_id"),
            "msg_type": header.get("msg_type"),
        }
    )


def to_v1(channel: str, msg: dict[str, Any]) -> bytes:
    """The ``v1.kernel.websocket.jupyter.org`` frame, buffers included."""
    parts = [dumps(msg.get(name) or {}).encode() for name in PARTS]
    return pack_v1(channel, parts + [bytes(b) for b in msg.get("buffers") or []])


def pack_v1(channel: str, parts: list[bytes]) -> bytes:
    """A v1 frame from already serialized parts (the four JSON dicts, then the buffers)."""
    chunks = [channel.encode(), *parts]
    count = len(chunks) + 1
    offsets = [8 * (1 + count)]
    for chunk in chunks:
        offsets.append(offsets[-1] + len(chunk))
    return struct.pack(f"<{count + 1}Q", count, *offsets) + b"".join(chunks)


# -- inbound ----------------------------------------------------------------------------------


def unpack_v1(frame: bytes) -> tuple[str, list[bytes]]:
    """Channel and parts (the four JSON dicts as bytes, then the buffers) of a v1 frame."""
    if len(frame) < 8:
        raise WireError(f"a v1 frame needs at least 8 bytes, got {len(frame)}")
    (count,) = struct.unpack_from("<Q", frame)
    if not 6 <= count <= MAX_V1_OFFSETS or len(frame) < 8 * (count + 1):
        raise WireError(
            f"a v1 frame declares {count} offsets in {len(frame)} bytes; a Jupyter "
            f"message has 6 (channel, 4 dicts, end) plus one per buffer"
        )
    offsets = struct.unpack_from(f"<{count}Q", frame, 8)
    if offsets[0] != 8 * (count + 1) or offsets[-1] != len(frame) or any(b < a for a, b in pairwise(offsets)):
        raise WireError(
            "a v1 frame's offsets are not increasing from the end of its offset table to the end of the frame"
        )
    try:
        channel = frame[offsets[0] : offsets[1]].decode()
    except UnicodeDecodeError:
        raise WireError("a v1 frame's channel name is not UTF-8") from None
    return channel, [frame[a:b] for a, b in pairwise(offsets[1:])]


def from_v1(frame: bytes) -> tuple[str, dict[str, Any]]:
    channel, parts = unpack_v1(frame)
    msg: dict[str, Any] = {}
    for name, raw in zip(PARTS, parts[:4], strict=True):
        try:
            msg[name] = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise WireError(f"the {name} of a v1 frame is not JSON: {exc}") from None
    msg["buffers"] = parts[4:]
    return channel, check(msg, channel)


def from_text(text: str) -> tuple[str, dict[str, Any]]:
    """A legacy text frame; a missing ``channel`` means shell (as in jupyter_server)."""
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise WireError(f"a text frame must be one JSON object: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"a text frame must be a JSON object, got {type(obj).__name__}")
    channel = obj.get("channel") or "shell"
    return channel, check({**obj, "buffers": []}, channel)


def from_legacy_binary(frame: bytes) -> tuple[str, dict[str, Any]]:
    """A legacy binary frame: the JSON message, then its buffers."""
    if len(frame) < 8:
        raise WireError(f"a binary frame needs at least 8 bytes, got {len(frame)}")
    (nbufs,) = struct.unpack_from("!I", frame)
    if not 1 <= nbufs <= MAX_V1_OFFSETS or len(frame) < 4 * (nbufs + 1):
        raise WireError(f"a binary frame declares {nbufs} parts in {len(frame)} bytes")
    offsets = [*struct.unpack_from(f"!{nbufs}I", frame, 4), len(frame)]
    if offsets[0] != 4 * (nbufs + 1) or any(b < a for a, b in pairwise(offsets)):
        raise WireError("a binary frame's offsets are not increasing")
    channel, msg = from_text(frame[offsets[0] : offsets[1]].decode("utf-8", "replace"))
    msg["buffers"] = [frame[a:b] for a, b in pairwise(offsets[1:])]
    return channel, msg


def check(msg: dict[str, Any], channel: Any) -> dict[str, Any]:
    """The message in its canonical shape, or ``WireError`` naming the field at fault."""
    if channel not in CHANNELS:
        raise WireError(f"channel {channel!r:.40} is not one of {', '.join(CHANNELS)}")
    header = msg.get("header")
    if not isinstance(header, dict):
        raise WireError("a Jupyter message needs a 'header' object")
    for name in ("msg_id", "msg_type"):
        if not isinstance(header.get(name), str) or not header[name]:
            raise WireError(f"header.{name} must be a non-empty string")
    parent = msg.get("parent_header")
    if parent is None:
        parent = {}  # JupyterLab and others send null for "no parent"
    if not isinstance(parent, dict):
        raise WireError("'parent_header' must be an object (or null)")
    metadata = msg.get("metadata") or {}
    content = msg.get("content")
    if content is None:
        content = {}
    if not isinstance(metadata, dict) or not isinstance(content, dict):
        raise WireError("'metadata' and 'content' must be objects")
    buffers = msg.get("buffers") or []
    return {
        "header": header,
        "parent_header": parent,
        "metadata": metadata,
        "content": content,
        "buffers": [bytes(b) for b in buffers],
    }
