"""AgentClient, the host's asyncio client of the guest agent, against a scriptable fake agent.

Covers request/reply matching, connect retries, routing of Jupyter messages by parent msg_id,
and ``close()``; ``test_channel_violations.py`` has protocol violations, EOF and backpressure.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import pytest

from kernelhost.channel import (
    AgentClient,
    AgentError,
    ChannelClosed,
    ChannelTimeout,
    JupyterMessage,
)
from kernelhost.channel.client import PROCESS_ID_KEY, request_id

from .fake_agent import (
    WAIT,
    Closes,
    FakeAgent,
    jupyter_msg,
)

pytestmark = pytest.mark.unit

LIMIT = 4096


@pytest.fixture
async def connect(sock_path):
    """``await connect(**kwargs) -> (client, closes)``; every client is closed at teardown."""
    clients: list[AgentClient] = []

    async def make(on_message: Any = None, on_event: Any = None, **kwargs: Any) -> tuple[AgentClient, Closes]:
        closes = Hooks(on_message, on_event)
        kwargs.setdefault("max_frame_bytes", LIMIT)
        client = AgentClient(sock_path, **kwargs)
        client.add_listener(closes)
        clients.append(client)
        await client.connect(timeout=WAIT)
        return client, closes

    yield make
    for client in clients:
        await asyncio.wait_for(client.close(), WAIT)


class Hooks(Closes):
    """Records closes, and hands messages and events to the given functions."""

    def __init__(self, on_message: Any = None, on_event: Any = None) -> None:
        super().__init__()
        self._on_message = on_message
        self._on_event = on_event

    def on_message(self, message: JupyterMessage) -> None:
        if self._on_message is not None:
            self._on_message(message)

    def on_event(self, event: dict[str, Any]) -> None:
        super().on_event(event)
        if self._on_event is not None:
            self._on_event(event)


async def round_trip(client: AgentClient) -> None:
    """A ping answered: everything the agent sent before the reply has been dispatched."""
    assert (await client.request("ping", timeout=WAIT))["ok"] is True


# -- requests ------------------------------------------------------------------------------------


async def test_request_and_reply(agent, connect):
    client, closes = await connect()
    agent.reply_fields["hello"] = {"agent_version": 1, "boot_id": "b00t"}
    reply = await client.request("hello", timeout=WAIT, extra={"k": [1, 2]})
    assert reply["ok"] is True
    assert reply["agent_version"] == 1
    assert reply["boot_id"] == "b00t"
    [sent] = agent.requests("hello")
    assert sent == {"op": "hello", "id": reply["id"], "extra": {"k": [1, 2]}}
    assert client.connected
    assert client._pending == {}
    assert closes.calls == []


async def test_concurrent_requests_are_matched_by_id(agent, connect):
    client, _ = await connect()
    agent.replies["echo"] = "ignore"
    n = 10
    tasks = [asyncio.create_task(client.request("echo", timeout=WAIT, value=i)) for i in range(n)]
    await agent.wait_until(lambda: len(agent.requests("echo")) == n)
    ids = [f["id"] for f in agent.requests("echo")]
    assert len(set(ids)) == n
    for frame in reversed(agent.requests("echo")):  # answer out of order
        await agent.reply(frame, value=frame["value"] * 100)
    replies = await asyncio.wait_for(asyncio.gather(*tasks), WAIT)
    assert [r["value"] for r in replies] == [i * 100 for i in range(n)]
    assert client._pending == {}


async def test_reply_with_ok_false_raises_agent_error(agent, connect):
    client, closes = await connect()
    agent.replies["restart"] = "error"
    with pytest.raises(AgentError, match="fake agent refuses"):
        await client.request("restart", timeout=WAIT)
    await round_trip(client)  # a refusal is not a protocol error
    assert closes.calls == []


async def test_reply_without_ok_raises_agent_error(agent, connect):
    client, _ = await connect()

    async def no_ok(fake: FakeAgent, frame: dict[str, Any]) -> None:
        await fake.send({"op": "reply", "id": frame["id"]})

    agent.replies["ping"] = no_ok
    with pytest.raises(AgentError):
        await client.request("ping", timeout=WAIT)


async def test_request_timeout_then_late_reply_is_ignored(agent, connect):
    client, closes = await connect()
    agent.replies["interrupt"] = "ignore"
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout):
        await client.request("interrupt", timeout=0.1)
    assert time.monotonic() - t0 < WAIT
    assert client._pending == {}
    late = await agent.wait_for_request("interrupt")
    await agent.reply(late)
    await round_trip(client)
    assert client.connected
    assert closes.calls == []
    assert client.stats.late_replies == 1


async def test_a_reply_sent_twice_is_dropped_and_a_flood_of_them_cut_off(agent, connect):
    """A guest's port may send a frame twice across a host's reconnect: the second answer is
    dropped, never taken for another request's; a guest repeating answers by the thousand is
    playing games."""
    client, closes = await connect()
    await round_trip(client)
    answered = await agent.wait_for_request("ping")
    await agent.reply(answered)
    await round_trip(client)
    assert client.connected and client.stats.repeated_replies == 1
    client._spare_replies = 1
    await agent.reply(answered)
    await agent.reply(answered)
    reason, violation = await closes.wait()
    assert violation and "again" in reason


@pytest.mark.parametrize("reply_id", [999, "1", None, 1.0, 0, -1, True])
async def test_replies_to_requests_never_made_are_violations(agent, connect, reply_id):
    """A guest repeating a reply nobody asked for must not be free: it is cut off."""
    client, closes = await connect()
    await round_trip(client)
    await agent.send({"op": "reply", "id": reply_id, "ok": True})
    reason, violation = await closes.wait()
    assert violation and "never made" in reason


async def test_answers_to_an_earlier_channels_requests_are_dropped_and_invented_ones_cut_off(agent, connect):
    """A restored or re-attached guest may answer requests of the channel it had before (a fork
    taken while the sampler's read was in flight): those answers are dropped, never matched to
    this channel's own requests, and the channel stays open. An id no channel of the service
    made (its tag is wrong) is a violation, and so is a flood of old ones."""
    key = b"k" * 32
    client, closes = await connect(id_key=key)
    await round_trip(client)
    own = await agent.wait_for_request("ping")
    earlier = AgentClient("/nonexistent", id_key=key)  # the guest's channel before this one
    earlier_ids = [request_id(key, earlier._first_counter + n) for n in range(3)]
    assert not set(earlier_ids) & {own["id"]}
    for stale in earlier_ids:
        await agent.send({"op": "reply", "id": stale, "ok": True})
    await round_trip(client)
    assert client.connected and closes.calls == []
    assert client.stats.earlier_replies == 3
    client._spare_replies = 1
    await agent.send({"op": "reply", "id": request_id(key, earlier._first_counter + 3), "ok": True})
    await agent.send({"op": "reply", "id": request_id(key, earlier._first_counter + 4), "ok": True})
    reason, violation = await closes.wait()
    assert violation and "earlier channels" in reason


async def test_an_id_under_another_key_was_never_made(agent, connect):
    client, closes = await connect(id_key=b"k" * 32)
    await round_trip(client)
    forged = request_id(b"x" * 32, client._first_counter)  # the right counter, a wrong tag
    await agent.send({"op": "reply", "id": forged, "ok": True})
    reason, violation = await closes.wait()
    assert violation and "never made" in reason


def test_two_channels_start_their_counters_apart(sock_path):
    firsts = sorted(AgentClient(sock_path)._first_counter for _ in range(64))
    assert len(set(firsts)) == 64 and firsts[0] >= 1 << 20
    assert request_id(PROCESS_ID_KEY, firsts[-1] + 10**6) < 1 << 53  # JSON-safe, for the logs


async def test_request_before_connect_raises_channel_closed(sock_path):
    client = AgentClient(sock_path)
    assert not client.connected
    with pytest.raises(ChannelClosed, match="not connected"):
        await client.request("ping", timeout=WAIT)


async def test_send_jupyter_refuses_kernel_side_channels(agent, connect):
    client, _ = await connect()
    with pytest.raises(ValueError, match="iopub"):
        await client.send_jupyter("iopub", jupyter_msg("status", {}))


async def test_send_jupyter_reaches_the_agent(agent, connect):
    client, _ = await connect()
    msg = jupyter_msg("kernel_info_request", {})
    await client.send_jupyter("control", msg)
    frame = await agent.wait_for_request("jupyter")
    assert frame == {"op": "jupyter", "channel": "control", "msg": msg}


# -- connect -------------------------------------------------------------------------------------


async def test_connect_retries_until_the_socket_appears(sock_path, monkeypatch):
    real_open = asyncio.open_unix_connection
    failures = 0
    retried = asyncio.Event()

    async def counting_open(*args: Any, **kwargs: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        nonlocal failures
        try:
            return await real_open(*args, **kwargs)
        except (FileNotFoundError, ConnectionRefusedError):
            failures += 1
            if failures >= 3:
                retried.set()
            raise

    monkeypatch.setattr(asyncio, "open_unix_connection", counting_open)
    closes = Closes()
    client = AgentClient(sock_path)
    client.add_listener(closes)
    connecting = asyncio.create_task(client.connect(timeout=WAIT))
    fake = None
    try:
        await asyncio.wait_for(retried.wait(), WAIT)  # it failed and kept trying
        assert not connecting.done()
        fake = await FakeAgent(sock_path).start()
        await asyncio.wait_for(connecting, WAIT)
        await asyncio.wait_for(fake.connected.wait(), WAIT)
        assert client.connected
        await round_trip(client)
    finally:
        connecting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await connecting
        await client.close()
        if fake is not None:
            await fake.stop()
    assert closes.calls == [("closed by the host", False)]


@pytest.mark.parametrize("stale_socket_file", [False, True], ids=["missing", "refused"])
async def test_connect_gives_up_at_its_deadline(sock_path, stale_socket_file):
    if stale_socket_file:  # a socket file nobody listens on: ECONNREFUSED, retried too
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(sock_path)
    client = AgentClient(sock_path)
    t0 = time.monotonic()
    with pytest.raises(ChannelTimeout, match="did not accept a connection"):
        await asyncio.wait_for(client.connect(timeout=0.2), WAIT)
    elapsed = time.monotonic() - t0
    assert 0.2 <= elapsed < WAIT
    assert not client.connected
    await client.close()


# -- routing -------------------------------------------------------------------------------------


async def test_messages_are_routed_by_parent_msg_id(agent, connect):
    seen: list[JupyterMessage] = []
    client, closes = await connect(on_message=seen.append)
    sub_a, sub_b = client.subscribe("a"), client.subscribe("b")
    sent = [
        ("iopub", jupyter_msg("status", {"execution_state": "busy"}, "a")),
        ("iopub", jupyter_msg("stream", {"name": "stdout", "text": "b1"}, "b")),
        ("iopub", jupyter_msg("stream", {"name": "stdout", "text": "c1"}, "c")),  # nobody's
        ("iopub", jupyter_msg("status", {"execution_state": "starting"})),  # no parent
        ("iopub", jupyter_msg("stream", {"name": "stdout", "text": "a1"}, "a", buffers=[b"\0"])),
        ("shell", jupyter_msg("execute_reply", {"status": "ok"}, "b")),
        ("shell", jupyter_msg("execute_reply", {"status": "ok"}, "a")),
    ]
    for channel, msg in sent:
        await agent.emit(channel, msg)

    got_a = [await sub_a.get(timeout=WAIT) for _ in range(3)]
    got_b = [await sub_b.get(timeout=WAIT) for _ in range(2)]
    assert [(m.channel, m.msg) for m in got_a] == [sent[0], sent[4], sent[6]]
    assert [(m.channel, m.msg) for m in got_b] == [sent[1], sent[5]]
    assert [m.msg_type for m in got_a] == ["status", "stream", "execute_reply"]
    assert got_a[1].content == {"name": "stdout", "text": "a1"}
    assert got_a[1].parent_id == "a"
    assert got_a[1].msg["buffers"] == [b"\0"]

    await round_trip(client)
    assert sub_a.queue.empty() and sub_b.queue.empty()
    assert [(m.channel, m.msg) for m in seen] == sent  # on_message sees everything
    assert JupyterMessage("iopub", sent[3][1]).parent_id is None
    assert closes.calls == []


async def test_subscription_get_times_out(agent, connect):
    client, _ = await connect()
    with client.subscribe("quiet") as sub, pytest.raises(TimeoutError):
        await sub.get(timeout=0.05)
    assert "quiet" not in client._subs


async def test_messages_for_a_closed_subscription_are_dropped(agent, connect):
    client, closes = await connect(queue_size=1)
    with client.subscribe("gone") as sub:
        pass
    for i in range(20):  # far more than queue_size: must not block the reader
        await agent.emit("iopub", jupyter_msg("stream", {"name": "stdout", "text": str(i)}, "gone"))
    await round_trip(client)
    assert sub.queue.empty()
    assert "gone" not in client._subs
    assert closes.calls == []


async def test_flood_of_unsolicited_messages_does_not_block_the_reader(agent, connect):
    client, closes = await connect(queue_size=2)
    flood = agent.spawn(agent.flood("nobody", count=500, size=1024))
    await asyncio.wait_for(flood, WAIT)
    await round_trip(client)
    assert closes.calls == []


async def test_events_reach_on_event(agent, connect):
    events: list[dict[str, Any]] = []
    got = asyncio.Event()

    def on_event(event: dict[str, Any]) -> None:
        events.append(event)
        if len(events) == 2:
            got.set()

    _, closes = await connect(on_event=on_event)
    await agent.event("kernel_died", exit_code=-9)
    await agent.event("kernel_restarted", reason="died")
    await asyncio.wait_for(got.wait(), WAIT)
    assert events == [
        {"op": "event", "event": "kernel_died", "exit_code": -9},
        {"op": "event", "event": "kernel_restarted", "reason": "died"},
    ]
    assert closes.calls == []


# -- close ---------------------------------------------------------------------------------------


async def test_close_is_idempotent_and_wakes_waiters(agent, connect):
    client, closes = await connect()
    sub = client.subscribe("p")
    agent.replies["ping"] = "ignore"
    pending = asyncio.create_task(client.request("ping", timeout=WAIT))
    await agent.wait_for_request("ping")
    waiting = asyncio.create_task(sub.get())
    await asyncio.wait_for(asyncio.gather(client.close(), client.close()), WAIT)
    await asyncio.wait_for(client.close(), WAIT)
    assert closes.calls == [("closed by the host", False)]
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(pending, WAIT)
    with pytest.raises(ChannelClosed):
        await asyncio.wait_for(waiting, WAIT)
    assert not client.connected
    with pytest.raises(ChannelClosed):
        await client.request("ping", timeout=WAIT)
    with pytest.raises(ChannelClosed):
        await client.send_jupyter("shell", jupyter_msg("execute_request", {}))
    await asyncio.wait_for(agent.disconnected.wait(), WAIT)


async def test_close_without_connect(sock_path):
    closes = Closes()
    client = AgentClient(sock_path)
    client.add_listener(closes)
    await client.close()
    await client.close()
    assert closes.calls == [("closed by the host", False)]


async def test_subscription_is_bounded_in_bytes_not_only_in_messages():
    from kernelhost.channel.messages import JupyterMessage, Subscription

    class _Owner:
        closed_reason = None

        def _unsubscribe(self, sub: Subscription) -> None:
            pass

    sub = Subscription(_Owner(), "p", maxsize=1000, max_bytes=100)

    def msg(size: int) -> JupyterMessage:
        return JupyterMessage(
            "iopub", {"header": {"msg_type": "stream"}, "parent_header": {}, "content": {}}, size
        )

    await asyncio.wait_for(sub.put(msg(80)), WAIT)
    second = asyncio.create_task(sub.put(msg(80)))
    done, _ = await asyncio.wait({second}, timeout=0.2)
    assert not done and sub.queued_bytes == 80  # held back: 160 bytes would exceed 100
    assert (await sub.get(timeout=WAIT)).size == 80
    await asyncio.wait_for(second, WAIT)  # room again: the reader moves on
    assert sub.queued_bytes == 80
    third = asyncio.create_task(sub.put(msg(80)))
    sub.close()  # a closed subscription never blocks the channel reader
    await asyncio.wait_for(third, WAIT)
    assert sub.queued_bytes == 0


# -- faults of the host's own code ---------------------------------------------------------------


async def test_a_listener_that_raises_does_not_break_the_channel(agent, connect):
    def broken(message: JupyterMessage) -> None:
        raise RuntimeError("a bug in a listener")

    client, closes = await connect(on_message=broken)
    with client.subscribe("p") as sub:
        await agent.emit("iopub", jupyter_msg("stream", {"name": "stdout", "text": "x"}, "p"))
        assert (await sub.get(timeout=WAIT)).content["text"] == "x"  # still delivered
    await round_trip(client)
    assert client.connected and closes.calls == []


async def test_a_bug_in_the_readers_own_code_is_not_a_protocol_violation(agent, connect, monkeypatch):
    """A host-side fault while handling a frame is logged and the frame dropped: the guest did
    nothing wrong, so its channel (and the user's sandbox) must survive."""
    from kernelhost.channel import client as client_module
    from kernelhost.channel.messages import check_jupyter as real  # the function the reader calls

    calls = 0

    def flaky(frame: dict[str, Any], size: int = 0) -> JupyterMessage:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise KeyError("a bug in the host's reader")
        return real(frame, size)

    monkeypatch.setattr(client_module, "check_jupyter", flaky)
    client, closes = await connect()
    with client.subscribe("p") as sub:
        await agent.emit("iopub", jupyter_msg("stream", {"name": "stdout", "text": "lost"}, "p"))
        await agent.emit("iopub", jupyter_msg("stream", {"name": "stdout", "text": "kept"}, "p"))
        assert (await sub.get(timeout=WAIT)).content["text"] == "kept"
    await round_trip(client)
    assert client.connected and closes.calls == []
