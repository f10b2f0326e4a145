"""The sans-IO frame codec shared by the host and the guest agent.

Wire format: 4-byte big-endian length, then one msgpack map with a string ``op``. The decoder must
never hold more than ``max_frame_bytes + 4`` bytes, must reject an oversize frame from its header
alone, and must stay poisoned after any framing error.
"""

from __future__ import annotations

import itertools
import random
import struct
from collections.abc import Iterable
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kernelhost.channel.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameDecoder,
    FrameError,
    FrameTooLarge,
    MalformedFrame,
    encode_frame,
)

pytestmark = pytest.mark.unit

LIMIT = 4096  # small, so the hypothesis tests hit the limit often
HEADER = struct.Struct(">I")


def frame(message: dict[str, Any]) -> bytes:
    return encode_frame(message, LIMIT)


def raw_frame(body: bytes) -> bytes:
    """A correctly length-prefixed frame around an arbitrary body."""
    return HEADER.pack(len(body)) + body


def feed_all(decoder: FrameDecoder, chunks: Iterable[bytes]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    return out


def split(data: bytes, cuts: Iterable[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 <= c <= len(data)} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


NESTED: dict[Any, Any] = {  # mixed keys: one is an int on purpose
    "op": "jupyter",
    "channel": "iopub",
    "msg": {
        "header": {"msg_id": "abc", "msg_type": "display_data", "date": "2024-01-01T00:00:00Z"},
        "parent_header": {},
        "metadata": {"image/png": {"width": 10, "height": 20}},
        "content": {
            "data": {"text/plain": "x", "image/png": b"\x89PNG\r\n\x1a\n\x00\xff"},
            "nested": [[1, [2, [3, {"deep": None}]]], {"k": [True, False, 1.5, -2]}],
        },
        "buffers": [b"", b"\x00" * 100, bytes(range(256))],
    },
    "ints": [0, -1, 2**31, -(2**31), 2**63 - 1, -(2**63), 2**64 - 1],
    "unicode": "héllo wörld ✓ 🐍",
    7: "int keys survive",
}


# -- round trips ---------------------------------------------------------------------------------


def test_round_trip_nested_maps_and_binary_buffers():
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(frame(NESTED)) == [NESTED]
    assert decoder.buffered == 0


def test_bytes_stay_bytes_and_str_stays_str():
    [out] = FrameDecoder(LIMIT).feed(frame({"op": "x", "b": b"abc", "s": "abc"}))
    assert type(out["b"]) is bytes
    assert type(out["s"]) is str


def test_wire_format_is_big_endian_length_then_msgpack_map():
    data = frame({"op": "ping", "id": 1})
    body = msgpack.packb({"op": "ping", "id": 1}, use_bin_type=True)
    assert data == struct.pack(">I", len(body)) + body


def test_empty_feed_returns_nothing():
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(b"") == []
    assert decoder.buffered == 0


def test_frame_split_at_every_byte_boundary():
    messages: list[dict[str, Any]] = [{"op": "a", "n": 1}, NESTED, {"op": "b"}]
    data = b"".join(frame(m) for m in messages)
    for cut in range(len(data) + 1):
        decoder = FrameDecoder(LIMIT)
        assert feed_all(decoder, [data[:cut], data[cut:]]) == messages, cut
        assert decoder.buffered == 0


def test_frame_fed_one_byte_at_a_time():
    data = frame(NESTED)
    decoder = FrameDecoder(LIMIT)
    for i in range(len(data) - 1):
        assert decoder.feed(data[i : i + 1]) == []
        assert decoder.buffered <= LIMIT + 4
    assert decoder.feed(data[-1:]) == [NESTED]
    assert decoder.buffered == 0


def test_several_frames_in_one_feed():
    messages = [{"op": "reply", "id": i, "ok": True} for i in range(50)]
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(b"".join(frame(m) for m in messages)) == messages


def test_several_frames_and_a_partial_one_in_one_feed():
    whole = frame({"op": "a"}) + frame({"op": "b"})
    partial = frame({"op": "c", "pad": "x" * 100})
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(whole + partial[:50]) == [{"op": "a"}, {"op": "b"}]
    assert decoder.buffered == 50 - 4  # header consumed, 46 body bytes held
    assert decoder.feed(partial[50:]) == [{"op": "c", "pad": "x" * 100}]


def _message_with_body_size(size: int) -> dict[str, Any]:
    """A message whose msgpack body is exactly ``size`` bytes (256 <= size < 65536)."""
    probe = 300  # any pad in bin16 range: the bin header size is then fixed
    overhead = len(msgpack.packb({"op": "x", "p": b"\x00" * probe}, use_bin_type=True)) - probe
    message = {"op": "x", "p": b"\x00" * (size - overhead)}
    assert len(msgpack.packb(message, use_bin_type=True)) == size
    return message


def test_frame_of_exactly_the_limit_is_accepted():
    message = _message_with_body_size(LIMIT)
    data = frame(message)
    assert len(data) == LIMIT + 4
    decoder = FrameDecoder(LIMIT)
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == LIMIT - 1
    assert decoder.feed(data[-1:]) == [message]


# -- length header -------------------------------------------------------------------------------


def test_zero_length_frame_is_malformed():
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(MalformedFrame):
        decoder.feed(b"\x00\x00\x00\x00")
    assert decoder.buffered == 0


@pytest.mark.parametrize("length", [LIMIT + 1, 1 << 20, 0xFFFFFFFF])
def test_oversize_length_header_rejected_before_the_body(length):
    decoder = FrameDecoder(LIMIT)
    header = HEADER.pack(length)
    for byte in header[:-1]:
        assert decoder.feed(bytes([byte])) == []
        assert decoder.buffered < 4
    with pytest.raises(FrameTooLarge) as info:
        decoder.feed(header[-1:])  # nothing of the body has been sent
    assert info.value.length == length
    assert info.value.limit == LIMIT
    assert isinstance(info.value, FrameError)
    assert decoder.buffered == 0


def test_oversize_header_after_valid_frames_in_the_same_feed():
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(FrameTooLarge):
        decoder.feed(frame({"op": "ok"}) + HEADER.pack(LIMIT + 1) + b"\x00" * 10)
    assert decoder.buffered == 0


def test_default_limit_is_used_when_not_given():
    decoder = FrameDecoder()
    assert decoder.max_frame_bytes == DEFAULT_MAX_FRAME_BYTES
    with pytest.raises(FrameTooLarge):
        decoder.feed(HEADER.pack(DEFAULT_MAX_FRAME_BYTES + 1))


@pytest.mark.parametrize("limit", [0, -1])
def test_decoder_rejects_a_non_positive_limit(limit):
    with pytest.raises(ValueError):
        FrameDecoder(limit)


# -- malformed bodies ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(msgpack.packb([1, 2, 3]), id="array"),
        pytest.param(msgpack.packb(42), id="int"),
        pytest.param(msgpack.packb("op"), id="str"),
        pytest.param(msgpack.packb(None), id="nil"),
        pytest.param(msgpack.packb(b"op", use_bin_type=True), id="bin"),
        pytest.param(msgpack.packb({}), id="empty-map"),
        pytest.param(msgpack.packb({"id": 1}), id="missing-op"),
        pytest.param(msgpack.packb({"op": 1}), id="int-op"),
        pytest.param(msgpack.packb({"op": None}), id="nil-op"),
        pytest.param(msgpack.packb({"op": b"ping"}, use_bin_type=True), id="bytes-op"),
        pytest.param(msgpack.packb({"op": ["ping"]}), id="list-op"),
        pytest.param(msgpack.packb({b"op": "ping"}, use_bin_type=True), id="bytes-key-op"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"\x82\xa2op", id="truncated-map"),
        pytest.param(msgpack.packb({"op": "x"}) + b"\x00", id="trailing-data"),
        pytest.param(b"\x81\x80\x01", id="map-key-is-a-map"),
        pytest.param(b"\x81\x91\x01\x01", id="map-key-is-a-list"),
        pytest.param(b"\x81\xa2op\xa2\xff\xfe", id="invalid-utf8"),
        pytest.param(b"\x91" * 2000 + b"\xc0", id="deep-nesting"),
        pytest.param(b"\xdd\xff\xff\xff\xff", id="huge-array-count"),
        pytest.param(b"\x81\xa2op\xd4\xff\x00", id="bad-timestamp"),
    ],
)
def test_malformed_body(body):
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(MalformedFrame):
        decoder.feed(raw_frame(body))
    assert decoder.buffered == 0


def test_decoder_is_poisoned_after_an_error():
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(MalformedFrame) as first:
        decoder.feed(raw_frame(msgpack.packb([1])))
    for data in (frame({"op": "ping"}), b"", b"\x00"):
        with pytest.raises(MalformedFrame, match="earlier bad frame") as again:
            decoder.feed(data)
        assert str(first.value) in str(again.value)
        assert decoder.buffered == 0


def test_decoder_is_poisoned_after_frame_too_large():
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(FrameTooLarge):
        decoder.feed(HEADER.pack(LIMIT + 1))
    with pytest.raises(MalformedFrame, match="earlier bad frame"):
        decoder.feed(frame({"op": "ping"}))


def test_a_poisoned_decoder_keeps_no_traceback():
    """The error's traceback holds the frame being decoded; the decoder keeps only its message,
    so an object bomb's partial objects go as soon as the reader stops (no cycle to wait for)."""
    decoder = FrameDecoder(LIMIT)
    with pytest.raises(MalformedFrame):
        decoder.feed(raw_frame(msgpack.packb([1])))
    assert not any(isinstance(v, BaseException) for v in vars(decoder).values())


# -- encode side ---------------------------------------------------------------------------------


def test_encode_rejects_a_frame_over_the_limit():
    message = _message_with_body_size(LIMIT + 1)
    with pytest.raises(FrameTooLarge) as info:
        encode_frame(message, LIMIT)
    assert info.value.length == LIMIT + 1
    assert info.value.limit == LIMIT
    assert len(encode_frame(_message_with_body_size(LIMIT), LIMIT)) == LIMIT + 4


@pytest.mark.parametrize(
    "message",
    [[("op", "x")], "op", None, {}, {"id": 1}, {"op": 1}, {"op": b"x"}],
    ids=["list", "str", "none", "empty", "missing-op", "int-op", "bytes-op"],
)
def test_encode_rejects_non_map_or_missing_op(message):
    with pytest.raises(MalformedFrame):
        encode_frame(message, LIMIT)


# -- properties ----------------------------------------------------------------------------------

keys = st.one_of(st.text(max_size=8), st.integers(min_value=-(2**63), max_value=2**64 - 1))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=12),
    st.binary(max_size=24),
)
values = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(keys, children, max_size=3),
    max_leaves=8,
)
messages = st.builds(
    lambda op, body: {**body, "op": op},
    st.text(max_size=10),
    st.dictionaries(st.text(max_size=8), values, max_size=3),
)


def _fits(message: dict[str, Any]) -> bool:
    return len(msgpack.packb(message, use_bin_type=True)) <= LIMIT


small_messages = messages.filter(_fits)


@st.composite
def chunkings(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = draw(st.lists(st.integers(min_value=0, max_value=len(data)), max_size=12))
    return split(data, cuts)


@st.composite
def hostile_segments(draw: st.DrawFn) -> bytes:
    """Pieces of a hostile stream: valid frames, plausible headers with random bodies, noise."""
    kind = draw(st.sampled_from(["frame", "header", "near-limit", "noise", "zero"]))
    if kind == "frame":
        return frame(draw(small_messages))
    if kind == "zero":
        return b"\x00\x00\x00\x00"
    if kind == "noise":
        return draw(st.binary(max_size=64))
    if kind == "near-limit":
        length = draw(st.integers(min_value=LIMIT - 8, max_value=LIMIT + 8))
    else:
        length = draw(st.integers(min_value=0, max_value=256))
    # body: random bytes (cheap for hypothesis: drawn from a seed), possibly short of `length`
    body_len = draw(st.integers(min_value=0, max_value=length))
    seed = draw(st.integers(min_value=0, max_value=2**32 - 1))
    return HEADER.pack(length) + random.Random(seed).randbytes(body_len)


hostile_streams = st.one_of(
    st.binary(max_size=2 * LIMIT),
    st.lists(hostile_segments(), max_size=8).map(b"".join),
)

PROPERTY_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,  # keep the checkout clean: no .hypothesis/ directory
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_arbitrary_streams_only_raise_frame_errors_and_stay_bounded(data):
    stream = data.draw(hostile_streams, label="stream")
    chunks = data.draw(chunkings(stream), label="chunks")
    decoder = FrameDecoder(LIMIT)
    failed: FrameError | None = None
    for chunk in chunks:
        try:
            frames = decoder.feed(chunk)
        except FrameError as exc:  # anything else fails the test
            if failed is not None:
                assert "earlier bad frame" in str(exc)  # poisoned: it says why it stopped
            failed = exc
        else:
            assert failed is None, "a poisoned decoder returned frames"
            for f in frames:
                assert isinstance(f, dict)
                assert isinstance(f["op"], str)
        assert decoder.buffered <= LIMIT + 4


@PROPERTY_SETTINGS
@given(data=st.data())
def test_truncated_streams_decode_to_the_complete_prefix(data):
    sent = data.draw(st.lists(small_messages, max_size=6), label="sent")
    encoded = [frame(m) for m in sent]
    stream = b"".join(encoded)
    cut = data.draw(st.integers(min_value=0, max_value=len(stream)), label="cut")
    decoder = FrameDecoder(LIMIT)
    got = feed_all(decoder, data.draw(chunkings(stream[:cut]), label="chunks"))

    ends, start, partial_start = [], 0, 0
    for e in encoded:
        ends.append(start + len(e))
        start += len(e)
    complete = sum(1 for end in ends if end <= cut)
    assert got == sent[:complete]
    partial_start = ends[complete - 1] if complete else 0
    held = cut - partial_start
    # a partial header is held as-is; once the header is complete only body bytes are held
    assert decoder.buffered == (held if held < 4 else held - 4)


@PROPERTY_SETTINGS
@given(data=st.data())
def test_garbage_after_a_valid_stream_never_yields_unsent_frames(data):
    sent = data.draw(st.lists(small_messages, max_size=4), label="sent")
    valid = b"".join(frame(m) for m in sent)
    # Every frame needs the key "op", whose msgpack encoding contains b"op": garbage without
    # those bytes can never hold a frame, so any frame after the valid ones would be invented.
    garbage = data.draw(
        st.one_of(
            st.binary(min_size=1, max_size=512),
            st.lists(hostile_segments(), min_size=1, max_size=4).map(b"".join),
        ).filter(lambda g: b"op" not in g),
        label="garbage",
    )
    assume(garbage)

    # 1. valid stream and garbage chunked together: what comes out is a prefix of what was sent
    decoder = FrameDecoder(LIMIT)
    got: list[dict[str, Any]] = []
    failed = False
    for chunk in data.draw(chunkings(valid + garbage), label="chunks"):
        try:
            got.extend(decoder.feed(chunk))
        except FrameError:
            failed = True
        assert decoder.buffered <= LIMIT + 4
    assert got == sent[: len(got)]
    if not failed:
        assert got == sent

    # 2. valid stream first, then garbage: every sent frame, and nothing from the garbage
    decoder = FrameDecoder(LIMIT)
    assert feed_all(decoder, data.draw(chunkings(valid), label="valid chunks")) == sent
    for chunk in data.draw(chunkings(garbage), label="garbage chunks"):
        try:
            assert decoder.feed(chunk) == []
        except FrameError:
            pass
        assert decoder.buffered <= LIMIT + 4


@PROPERTY_SETTINGS
@given(message=small_messages)
def test_round_trip_property(message):
    assert FrameDecoder(LIMIT).feed(frame(message)) == [message]
