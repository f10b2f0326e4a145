"""The lines of an NDJSON stream of execution events.

Most of an execution's bytes are its ``stdout``/``stderr`` text, and the standard library's JSON
encoder escapes a string a character at a time (some 4 ns each here: a quarter of a second per
64 MiB of output, on the same cores as the guest's vCPU). A stream event's text is encoded here
instead with a few whole-buffer passes: UTF-8 (JSON text may hold any character but the two
quotes' and the controls'), then the escapes of the backslash, the quote and the three common
controls; text holding any other control character, or a lone surrogate, takes the standard
encoder. Both give JSON that decodes to the same string.
"""

from __future__ import annotations

import json

from ...sandboxes import Event, Stream

__all__ = ["line"]

#: controls that need an escape of the \u00XX form (\n, \r and \t are replaced in bulk); each
#: is looked for alone (memchr), which beats a regular expression's class by ten times
_RARE_CONTROLS = tuple(bytes([c]) for c in range(0x20) if c not in b"\n\r\t")
_ESCAPES = ((b"\\", b"\\\\"), (b'"', b'\\"'), (b"\n", b"\\n"), (b"\r", b"\\r"), (b"\t", b"\\t"))
_STREAM_HEADS = {name: f'{{"type":"{name}","text":"'.encode() for name in ("stdout", "stderr")}


def line(event: Event) -> bytes:
    """One event's line (newline included). Raises what ``json.dumps`` raises for an event
    holding something that is not JSON data (NaN, a cycle)."""
    if isinstance(event, Stream):
        fast = _stream_line(event)
        if fast is not None:
            return fast
    return json.dumps(event.wire(), separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _stream_line(event: Stream) -> bytes | None:
    head = _STREAM_HEADS.get(event.name)
    if head is None:
        return None
    try:
        text = event.text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: the standard encoder escapes it
        return None
    if any(control in text for control in _RARE_CONTROLS):
        return None
    for raw, escaped in _ESCAPES:
        if raw in text:
            text = text.replace(raw, escaped)
    return b"".join((head, text, b'"}\n'))
