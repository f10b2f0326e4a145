"""AgentClient against the scriptable fake agent (``test_channel_client.py`` has the rest): every
kind of protocol violation closes the channel with ``violation=True`` and wakes whoever waits,
EOF does not, and a consumer that does not read stops the reader (backpressure) until it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from typing import Any

import pytest

from kernelhost.channel import (
    ChannelClosed,
)

from .fake_agent import (
    WAIT,
    jupyter_msg,
    raw_frame,
    unchecked_frame,
    wait_until_stalled,
)
from .test_channel_client import LIMIT, round_trip
from .test_channel_client import connect as connect  # the fixture: pytest finds it by its name

pytestmark = pytest.mark.unit


# -- protocol violations -------------------------------------------------------------------------


def _jupyter(channel: Any = "iopub", **changes: Any) -> bytes:
    """A jupyter frame for parent "p" with some fields of its msg replaced (or removed)."""
    msg: dict[str, Any] = jupyter_msg("stream", {"name": "stdout", "text": "x"}, "p")
    for key, value in changes.items():
        if value is _REMOVE:
            del msg[key]
        else:
            msg[key] = value
    return unchecked_frame({"op": "jupyter", "channel": channel, "msg": msg})


_REMOVE = object()

VIOLATIONS = [
    pytest.param(raw_frame(b"\x93\x01\x02\x03"), "bad frame", id="body-not-a-map"),
    pytest.param(unchecked_frame({"id": 1, "ok": True}), "bad frame", id="missing-op"),
    pytest.param(unchecked_frame({"op": 7}), "bad frame", id="op-not-a-string"),
    pytest.param(raw_frame(b"\xc1"), "bad frame", id="invalid-msgpack"),
    pytest.param(raw_frame(b""), "bad frame", id="zero-length"),
    pytest.param(struct.pack(">I", LIMIT + 1), "exceeds the limit", id="oversize-header"),
    pytest.param(struct.pack(">I", 0xFFFFFFFF), "exceeds the limit", id="max-length-header"),
    pytest.param(unchecked_frame({"op": "launch"}), "unknown op", id="unknown-op"),
    pytest.param(unchecked_frame({"op": "event"}), "event", id="event-without-name"),
    pytest.param(unchecked_frame({"op": "event", "event": 3}), "event", id="event-name-not-str"),
    pytest.param(_jupyter("nope"), "malformed jupyter frame", id="unknown-channel"),
    pytest.param(_jupyter(None), "malformed jupyter frame", id="no-channel"),
    pytest.param(
        unchecked_frame({"op": "jupyter", "channel": "iopub", "msg": [1]}),
        "malformed jupyter frame",
        id="msg-not-a-map",
    ),
    pytest.param(_jupyter(header="status"), "header", id="header-not-a-map"),
    pytest.param(_jupyter(header=[1, 2]), "header", id="header-a-list"),
    pytest.param(_jupyter(header={"msg_id": "x"}), "header", id="header-without-msg-type"),
    pytest.param(_jupyter(header={"msg_type": 5}), "header", id="msg-type-not-str"),
    pytest.param(_jupyter(parent_header=_REMOVE), "parent_header", id="no-parent-header"),
    pytest.param(_jupyter(parent_header="p"), "parent_header", id="parent-header-not-a-map"),
    pytest.param(_jupyter(content=None), "content", id="content-not-a-map"),
    pytest.param(_jupyter(metadata=[]), "metadata", id="metadata-not-a-map"),
    pytest.param(_jupyter(buffers=b"x"), "buffers", id="buffers-not-a-list"),
    pytest.param(_jupyter(buffers=["text"]), "buffers", id="buffer-not-bytes"),
    pytest.param(_jupyter(parent_header={"msg_id": 1}), "msg_id", id="parent-msg-id-not-str"),
    pytest.param(_jupyter(["shell"]), "malformed jupyter frame", id="channel-a-list"),
]


@pytest.mark.parametrize(("bad", "reason_part"), VIOLATIONS)
async def test_protocol_violation_closes_the_channel(agent, connect, bad, reason_part):
    client, closes = await connect()
    sub = client.subscribe("p")
    agent.replies["ping"] = "ignore"
    pending = asyncio.create_task(client.request("ping", timeout=WAIT))
    await agent.wait_for_request("ping")  # the request is in flight
    waiting = asyncio.create_task(sub.get())
    try:
        await agent.send_raw(bad)
        reason, violation = await closes.wait(timeout=2)
        assert violation is True
        assert reason_part in reason
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(pending, WAIT)
        with pytest.raises(ChannelClosed):
            await asyncio.wait_for(waiting, WAIT)
        assert not client.connected
        assert client.closed_reason == reason
        with pytest.raises(ChannelClosed):
            await client.request("ping", timeout=WAIT)
        await asyncio.wait_for(agent.disconnected.wait(), WAIT)  # the host hung up
        await client.close()
        assert closes.calls == [(reason, True)]  # once
    finally:
        for task in (pending, waiting):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await client.close()


async def test_eof_closes_without_violation(agent, connect):
    client, closes = await connect()
    sub = client.subscribe("p")
    agent.replies["ping"] = "ignore"
    pending = asyncio.create_task(client.request("ping", timeout=WAIT))
    await agent.wait_for_request("ping")
    waiting = asyncio.create_task(sub.get())
    await agent.disconnect()
    assert await closes.wait() == ("agent closed the channel", False)
    with pytest.raises(ChannelClosed, match="agent closed the channel"):
        await asyncio.wait_for(pending, WAIT)
    with pytest.raises(ChannelClosed, match="agent closed the channel"):
        await asyncio.wait_for(waiting, WAIT)
    assert not client.connected
    await client.close()
    assert closes.calls == [("agent closed the channel", False)]


# -- backpressure --------------------------------------------------------------------------------


async def test_backpressure_stops_reading_and_resumes(agent, connect):
    queue_size, count, size = 4, 600, 16 * 1024  # ~10 MB offered
    client, closes = await connect(queue_size=queue_size, max_frame_bytes=1 << 20)
    sub = client.subscribe("p")
    flood = agent.spawn(agent.flood("p", count=count, size=size))

    sent = await wait_until_stalled(lambda: agent.frames_sent, flood)
    # The reader stopped: the agent's writes block, and the host holds a bounded amount.
    assert not flood.done()
    assert sent < count
    assert sent * size <= 2 * 1024 * 1024
    assert sub.queue.qsize() == queue_size
    assert client._reader is not None and len(client._reader._buffer) <= 1024 * 1024

    # The consumer reads again: everything arrives, in order, and the flood completes.
    for i in range(count):
        msg = await sub.get(timeout=WAIT)
        assert msg.msg["metadata"]["seq"] == i
        assert sub.queue.qsize() <= queue_size
    await asyncio.wait_for(flood, WAIT)
    assert agent.frames_sent == count
    await round_trip(client)
    assert closes.calls == []


async def test_close_while_the_reader_is_blocked_on_a_full_queue(agent, connect):
    client, closes = await connect(queue_size=2, max_frame_bytes=1 << 20)
    sub = client.subscribe("p")
    flood = agent.spawn(agent.flood("p", count=400, size=16 * 1024))
    await wait_until_stalled(lambda: agent.frames_sent, flood)
    await asyncio.wait_for(client.close(), WAIT)
    assert closes.calls == [("closed by the host", False)]
    received = 0
    with pytest.raises(ChannelClosed):
        while True:
            await sub.get(timeout=WAIT)
            received += 1
    assert received <= 1  # what was left queued, then the close
    await asyncio.wait_for(agent.disconnected.wait(), WAIT)
