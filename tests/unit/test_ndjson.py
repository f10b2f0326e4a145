"""The NDJSON lines of execution events: a stream event's fast encoding decodes to its text."""

from __future__ import annotations

import json
import random

import pytest

from kernelhost.api.v1 import ndjson
from kernelhost.sandboxes import End, Error, ExecutionStatus, Result, Stream

pytestmark = pytest.mark.unit

CASES = [
    "",
    "plain",
    'q"uote\\back\nnl\r\t',
    "é€😀 and \u2028\u2029",
    "\x00\x01\x1f\x7f",
    "\ud800 a lone surrogate",
    "\x0b",
    "x" * 100_000 + "\n",
]


def random_texts(n: int) -> list[str]:
    rnd = random.Random(7)
    picks = [0x0A, 0x0D, 0x09, 0x22, 0x5C, 0x41, 0x7F, 0xE9, 0x20AC, 0x1F600, 0x01, 0xD800]
    return ["".join(chr(rnd.choice(picks)) for _ in range(rnd.randrange(0, 40))) for _ in range(n)]


@pytest.mark.parametrize("name", ["stdout", "stderr"])
def test_a_stream_line_decodes_to_its_text(name: str) -> None:
    for text in CASES + random_texts(2000):
        line = ndjson.line(Stream(name, text))
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        assert json.loads(line) == {"type": name, "text": text}


def test_other_events_are_plain_json() -> None:
    for event in (Error("E", "v", ["tb"]), End(ExecutionStatus.OK, 1.5)):
        assert json.loads(ndjson.line(event)) == event.wire()


def test_what_is_not_json_data_raises() -> None:
    with pytest.raises(ValueError):
        ndjson.line(Result({"text/plain": float("nan")}))
