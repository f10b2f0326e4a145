"""Stream messages relayed with their text as the kernel packed it (``streamwire``): the host
decodes the very message the slow path (``relay.parse``, ``split_stream``) gives it."""

from __future__ import annotations

from typing import Any

import kernel_wire
import msgpack
import pytest
from kernel_wire import pack, unpack
from kernelhost_agent import streamwire
from kernelhost_agent.limits import ExecutionMeter
from kernelhost_agent.relay import split_stream
from kernelhost_agent.streamwire import frame_parts, raw_stream

from kernelhost.channel import codec, protocol

pytestmark = pytest.mark.unit

HEADER = {"msg_id": "m1", "msg_type": "stream", "session": "s", "date": "2026-12-03T00:00:00Z"}
PARENT = {"msg_id": "p1", "msg_type": "execute_request"}


def _decoded(frames: list[tuple[bytes, memoryview]]) -> list[dict[str, Any]]:
    decoder = codec.FrameDecoder()
    out = []
    for head, tail in frames:
        out += decoder.feed(head + bytes(tail))
    assert decoder.buffered == 0
    return out


@pytest.mark.parametrize("size", [0, 5, 31, 200, 60_000, 70_000, 3 * (1 << 20) + 7])
@pytest.mark.parametrize("name", ["stdout", "stderr"])
def test_the_host_gets_what_the_slow_path_sends(size: int, name: str) -> None:
    text = "".join(chr(32 + i % 95) for i in range(size))
    content = pack({"name": name, "text": text})
    stream = raw_stream(memoryview(content))
    assert stream is not None and stream.name == name and stream.text == text.encode()
    frames = frame_parts("iopub", HEADER, PARENT, {}, stream, 1 << 20, codec.DEFAULT_MAX_FRAME_BYTES)
    content_map = {"name": name, "text": text}
    wire = {"header": HEADER, "parent_header": PARENT, "metadata": {}, "content": content_map, "buffers": []}
    slow = [{"op": protocol.Frame.JUPYTER.value, "channel": "iopub", "msg": m} for m in split_stream(wire)]
    assert _decoded(frames) == slow


@pytest.mark.parametrize(
    "content",
    [
        pack({"name": "stdout", "text": "caf\u00e9"}),  # not ASCII: the slow path decodes it
        pack({"name": "stdin", "text": "x"}),
        b"\x82\xa4text\xdb\x00\x00\x00\x01x\xa4name\xa5stdin",  # text first, another name
        b"\x82\xa4text\xdb\x00\x00\x00\x02x\xa4name\xa6stdout",  # text first, cut short
        b"\x82\xa4text\xdb\x00\x00\x00\x01x\xa4name\xa6stdout\x00",  # text first, a byte more
        pack({"name": "stdout", "text": "x", "more": 1}),
        pack({"name": "stdout", "text": b"x"}),
        pack({"name": "stdout"}),
        b'{"name": "stdout", "text": "x"}',  # JSON, from another kernel
        msgpack.packb({"name": "stdout", "text": "xy"})[:-1],  # cut short
        b"",
    ],
)
def test_anything_else_takes_the_slow_path(content: bytes) -> None:
    assert raw_stream(memoryview(content)) is None


@pytest.mark.parametrize("size", [4095, 4096, 1 << 20])
def test_the_kernel_packs_an_ascii_text_first_and_the_relay_sends_it_from_the_frame(size: int) -> None:
    assert streamwire.ASCII_HEAD == kernel_wire.ASCII_HEAD
    text = "".join(chr(32 + i % 95) for i in range(size))
    content = pack({"name": "stderr", "text": text})
    assert unpack(content) == {"name": "stderr", "text": text}
    first = bytes(content[:6])
    assert first == (b"\x82\xa4text" if size >= kernel_wire.ASCII_AT_LEAST else b"\x82\xa4name")
    stream = raw_stream(memoryview(content))
    assert stream is not None and stream.name == "stderr" and bytes(stream.text) == text.encode()
    # text first: the relay writes a view of the kernel's buffer, no copy of its own
    assert isinstance(stream.text, memoryview) == (size >= kernel_wire.ASCII_AT_LEAST)


@pytest.mark.parametrize(
    "content",
    [
        {"text": "\u00e9" * 5000, "name": "stdout"},  # not ASCII
        {"text": "x" * 5000, "name": "stdin"},  # not a stream the relay sends raw
        {"text": "x" * 5000, "name": 1},
    ],
)
def test_text_first_is_the_packers_ascii_promise_nothing_else_is_packed_so(content: dict[str, Any]) -> None:
    packed = pack(content)
    assert bytes(packed[:6]) == b"\x82\xa4name" and unpack(packed) == content


def test_a_frame_over_the_limit_is_refused() -> None:
    stream = raw_stream(memoryview(pack({"name": "stdout", "text": "x" * 5000})))
    assert stream is not None
    with pytest.raises(codec.FrameTooLarge):
        frame_parts("iopub", HEADER, PARENT, {}, stream, 1 << 20, 4096)


def test_a_stream_fits_its_cap_whole_or_is_left_for_the_cut() -> None:
    meter = ExecutionMeter(lambda: None)
    request = {"header": {"msg_id": "p1", "msg_type": "execute_request"}}
    meter.note_execute_request("shell", {**request, "metadata": {"kernelhost": {"max_output_bytes": 9}}})
    assert meter.stream_fits(PARENT, 6)  # 10 left (one more than the cap: the host sees the cut)
    assert not meter.stream_fits(PARENT, 5)  # 4 left: nothing taken, the slow path cuts it
    assert meter.stream_fits(PARENT, 4)
    assert meter.stream_fits({"msg_id": "another"}, 1 << 30)  # no cap noted for it
