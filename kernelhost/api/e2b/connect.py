"""The Connect protocol as E2B's envd speaks it, sans-IO: JSON messages, unary calls as plain
JSON bodies, server streams as enveloped messages (a flags byte, a big-endian uint32 length,
then the JSON), closed by an end-of-stream envelope (flag 0x02) that carries ``{}`` or
``{"error": {"code", "message"}}``.

No HTTP here: the views in ``envd.py`` put these bytes on the wire.
"""

from __future__ import annotations

import json
import struct
from typing import Any

STREAM_CONTENT_TYPE = "application/connect+json"
UNARY_CONTENT_TYPE = "application/json"
END_STREAM = 0x02
COMPRESSED = 0x01
MAX_REQUEST_MESSAGE = 1 << 20  # a request message of a stream (a command line, a path)

#: Connect error codes and the HTTP status a unary error is sent with
STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    """An RPC's failure, in Connect's terms (``code`` is one of ``STATUS``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        assert code in STATUS, code
        self.code = code
        self.message = message

    @property
    def status(self) -> int:
        return STATUS[self.code]

    def wire(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(message: dict[str, Any], flags: int = 0) -> bytes:
    body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    return struct.pack(">BI", flags, len(body)) + body


def end_stream(error: ConnectError | None = None) -> bytes:
    return envelope({} if error is None else {"error": error.wire()}, END_STREAM)


def parse_stream_request(body: bytes) -> dict[str, Any]:
    """The one message of a server-streaming request body."""
    if len(body) < 5:
        raise ConnectError("invalid_argument", "the request is not an enveloped Connect message")
    flags, length = struct.unpack(">BI", body[:5])
    if flags & COMPRESSED:
        raise ConnectError("unimplemented", "compressed messages are not supported (send identity)")
    if length > MAX_REQUEST_MESSAGE or len(body) < 5 + length:
        raise ConnectError(
            "invalid_argument", f"the request message is truncated or over {MAX_REQUEST_MESSAGE} bytes"
        )
    return parse_message(body[5 : 5 + length])


def parse_message(body: bytes) -> dict[str, Any]:
    try:
        message = json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "the request message is not JSON") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request message must be a JSON object")
    return message
