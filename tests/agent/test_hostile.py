"""Malformed and hostile frames: the agent answers with errors or drops them, never breaks.

After each of them the agent must still answer ping and run code; the module's fixture also
checks, at teardown, that no agent task failed and nothing was raised into the event loop.
"""

from __future__ import annotations

import struct
from typing import Any

import msgpack
import pytest

from kernelhost.channel import protocol

from .host import HostEnd, raw_frame

pytestmark = pytest.mark.unit

Op = protocol.Op


async def still_serving(host: HostEnd) -> None:
    await host.ping_until_answered()
    run = await host.execute("21 * 2")
    assert run.of_type("execute_result")[0]["content"]["data"]["text/plain"] == "42"


# -- framing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        msgpack.packb([1, 2, 3]),  # not a map
        msgpack.packb({"id": 1}),  # a map without op
        msgpack.packb({"op": 7, "id": 1}),  # op not a string
        b"\xc1\xc1\xc1",  # not msgpack at all
        b"\xdd\xff\xff\xff\xff",  # an array declaring 4 billion items
        msgpack.packb([[[[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]]) * 1,
    ],
    ids=["list", "no-op", "int-op", "garbage", "huge-array", "nested"],
)
async def test_malformed_frame_is_dropped(host: HostEnd, body: bytes) -> None:
    await host.send_raw(raw_frame(body))
    await host.ping_until_answered()


async def test_deep_nesting_is_dropped(host: HostEnd) -> None:
    deep = b"\x91" * 100_000 + b"\xc0"  # 100,000 nested one-element arrays
    await host.send_raw(raw_frame(deep))
    await host.ping_until_answered()


async def test_truncated_frame_then_garbage(host: HostEnd) -> None:
    body = msgpack.packb({"op": "ping", "id": 10**6})
    await host.send_raw(struct.pack(">I", len(body) + 40) + body)  # says 40 bytes more
    await host.send_raw(b"\xff" * 40 + b"garbage after the frame")
    await still_serving(host)


async def test_oversize_declared_length(host: HostEnd) -> None:
    await host.send_raw(struct.pack(">I", 0xFFFFFFFF) + b"x" * 100)
    await still_serving(host)


async def test_a_frame_of_zero_length(host: HostEnd) -> None:
    await host.send_raw(struct.pack(">I", 0))
    await host.ping_until_answered()


# -- requests ------------------------------------------------------------------------------------


async def test_unknown_op(host: HostEnd) -> None:
    reply = await host.request("nope")
    assert reply == {"op": "reply", "id": reply["id"], "ok": False, "error": "unknown op 'nope'"}


@pytest.mark.parametrize("op", ["reply", "event", "__init__", "op_hello", ""])
async def test_names_that_are_not_requests(host: HostEnd, op: str) -> None:
    assert await host.refused(op) == f"unknown op {op!r}"


@pytest.mark.parametrize("request_id", ["7", None, 1.5, [1], {"a": 1}])
async def test_a_request_without_an_integer_id(host: HostEnd, request_id: Any) -> None:
    """Answered like an unknown op, echoing the id (the host then finds no request of it)."""
    await host.send_unchecked({"op": "ping", "id": request_id})
    odd = await host.odd_reply()
    assert odd == {"op": "reply", "id": request_id, "ok": False, "error": "unknown op 'ping'"}


async def test_a_request_without_an_id(host: HostEnd) -> None:
    await host.send_unchecked({"op": "ping"})
    odd = await host.odd_reply()
    assert odd["id"] is None and odd["ok"] is False


async def test_ids_at_the_edges_of_msgpack(host: HostEnd) -> None:
    for request_id in (0, -1, 2**63, -(2**63)):
        await host.send_unchecked({"op": "ping", "id": request_id})
        odd = await host.odd_reply()  # not an id of HostEnd's: it lands here
        assert odd["id"] == request_id and odd["ok"] is True


LONG = "a" * 65
BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (Op.BASH, {"run_id": LONG, "command": "true"}, "run_id must be"),
    (Op.BASH, {"run_id": "../x", "command": "true"}, "run_id must be"),
    (Op.BASH, {"run_id": "", "command": "true"}, "run_id must be"),
    (Op.BASH, {"run_id": 7, "command": "true"}, "run_id must be"),
    (Op.BASH, {"run_id": "abc", "command": 7}, "command must be a string"),
    (Op.BASH, {"run_id": "abc", "command": b"true"}, "command must be a string"),
    (Op.BASH, {"run_id": "abc", "command": "true", "max_output_bytes": -1}, "max_output_bytes"),
    (Op.BASH, {"run_id": "abc", "command": "true", "max_output_bytes": True}, "max_output_bytes"),
    (Op.BASH, {"run_id": "abc", "command": "true", "max_output_bytes": "1"}, "max_output_bytes"),
    (Op.BASH_SIGNAL, {"run_id": None, "signal": "HUP"}, "signal must be one of INT, TERM, KILL"),
    (Op.BASH_SIGNAL, {"run_id": None, "signal": 9}, "signal must be one of"),
    (Op.BASH_SIGNAL, {"run_id": None, "signal": ["KILL"]}, "signal must be one of"),
    (Op.BASH_SIGNAL, {"run_id": ["x"], "signal": "KILL"}, "run_id must be a string or null"),
    (Op.FS_STAT, {"path": "a\0b"}, "path must be a non-empty path"),
    (Op.FS_STAT, {"path": ""}, "path must be"),
    (Op.FS_STAT, {"path": 7}, "path must be"),
    (Op.FS_STAT, {}, "path must be"),
    (Op.FS_STAT, {"path": "x" * 4097}, "at most 4096"),
    (Op.FS_READ, {"path": "f", "offset": -1, "length": 1}, "offset must be an integer"),
    (Op.FS_READ, {"path": "f", "offset": 0, "length": 0}, "length must be an integer"),
    (Op.FS_READ, {"path": "f", "offset": 0, "length": 2**40}, "length must be an integer"),
    (Op.FS_READ, {"path": "f", "offset": 2**63, "length": 1}, "offset must be an integer"),
    (Op.FS_READ, {"path": "f", "offset": False, "length": 1}, "offset must be an integer"),
    (Op.FS_READ, {"path": "f", "offset": "0", "length": 1}, "offset must be an integer"),
    (Op.FS_WRITE, {"path": "f", "offset": 0, "data": "text"}, "data must be bytes"),
    (Op.FS_WRITE, {"path": "f", "offset": 0, "data": b"x" * (4 * 2**20 + 1)}, "data must be bytes"),
    (Op.FS_WRITE, {"path": "f", "offset": -5, "data": b"x"}, "offset must be"),
    (Op.FS_RENAME, {"src": "a"}, "dst must be"),
    (Op.FS_RENAME, {"src": "a\0", "dst": "b"}, "src must be"),
    (Op.FS_LIST, {"path": ["."]}, "path must be"),
    (Op.FS_REMOVE, {"path": None}, "path must be"),
    (Op.NET_CONFIG, {"mode": "open"}, "mode must be none, allowlist or outbound"),
    (Op.NET_CONFIG, {"mode": ["none"]}, "mode must be"),
    (Op.NET_CONFIG, {"mode": "allowlist", "env": {"LD_PRELOAD": "x"}}, "env must map some of"),
    (Op.NET_CONFIG, {"mode": "allowlist", "env": {"HTTP_PROXY": 1}}, "env must map"),
    (Op.NET_CONFIG, {"mode": "allowlist", "env": ["HTTP_PROXY"]}, "env must map"),
    (Op.NET_CONFIG, {"mode": "allowlist", "env": {}, "pip": ["x"]}, "pip must be a map"),
    (Op.PREPARE_SNAPSHOT, {"preload": ["json; import os"]}, "not a module name"),
    (Op.PREPARE_SNAPSHOT, {"preload": "json"}, "preload must be a list"),
    (Op.PREPARE_SNAPSHOT, {"preload": 5}, "preload must be a list"),
]


@pytest.mark.parametrize(
    ("op", "fields", "expected"), BAD_FIELDS, ids=[f"{op}-{i}" for i, (op, _, _) in enumerate(BAD_FIELDS)]
)
async def test_wrong_fields_are_refused(
    host: HostEnd, op: str, fields: dict[str, Any], expected: str
) -> None:
    error = await host.refused(op, **fields)
    assert error.startswith("ValueError: ") and expected in error, error


async def test_still_serving_after_the_refusals(host: HostEnd) -> None:
    await still_serving(host)


# -- Jupyter frames ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "frame",
    [
        {"channel": "iopub", "msg": {}},  # the host may not publish
        {"channel": "heartbeat", "msg": {}},
        {"channel": ["shell"], "msg": {}},
        {"channel": "shell", "msg": "execute"},  # not a map
        {"channel": "shell", "msg": None},
        {"channel": "shell", "msg": {"content": {}}},  # no header: cannot be serialized
        {
            "channel": "shell",
            "msg": {"header": {}, "parent_header": {}, "metadata": {}, "content": {}, "buffers": "bytes?"},
        },
        {
            "channel": "shell",
            "msg": {"header": {}, "parent_header": {}, "metadata": {}, "content": {}, "buffers": [1, 2]},
        },
        {
            "channel": "control",
            "msg": {"header": {"msg_type": b"\xff"}, "parent_header": {}, "metadata": {}, "content": {}},
        },  # bytes: not JSON
        {"channel": "shell", "msg": {"header": ["x"], "parent_header": 5, "metadata": None, "content": "c"}},
        {
            "channel": "shell",
            "msg": {"header": {}, "parent_header": {}, "metadata": {}, "content": {"x": float("nan")}},
        },  # NaN: not JSON either
    ],
    ids=[
        "iopub",
        "heartbeat",
        "list-channel",
        "str-msg",
        "none-msg",
        "no-header",
        "str-buffers",
        "int-buffers",
        "bytes-header",
        "odd-types",
        "nan",
    ],
)
async def test_bad_jupyter_frames_are_dropped(host: HostEnd, frame: dict[str, Any]) -> None:
    await host.send_unchecked({"op": "jupyter", **frame})
    await host.ping_until_answered()


async def test_execute_request_with_odd_metadata_still_runs(host: HostEnd) -> None:
    for limits in (
        {"kernelhost": "none"},
        {"kernelhost": {"max_output_bytes": "10"}},
        {"kernelhost": {"max_output_bytes": True}},
        {"kernelhost": {"max_output_bytes": -3}},
    ):
        run = await host.execute("print('z' * 20)", metadata=limits)
        assert run.stream() == "z" * 20 + "\n"


async def test_net_frames_of_the_wrong_shape(host: HostEnd) -> None:
    for frame in ({"t": "data"}, {"t": 5, "tunnel": 1}, {"tunnel": [1]}, {"t": "ack", "tunnel": 1, "n": -5}):
        await host.send_unchecked({"op": "net", **frame})
    await host.ping_until_answered()


async def test_after_everything(host: HostEnd) -> None:
    await still_serving(host)
