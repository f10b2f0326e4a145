"""Raw bash output on the host: ``BashOutput`` (decoding ``bash_out`` frames into the stream
messages an older agent sends) and ``AgentClient.start_bash`` against a fake agent, including a
hostile one: frames of the wrong shape cut the channel off, frames of runs it did not start are
dropped, and nothing it sends makes the host hold more than a frame."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kernelhost.channel import AgentClient, ProtocolViolation
from kernelhost.channel.bash_output import BashOutput
from kernelhost.channel.protocol import BASH_OUT_MAX, Op

from .fake_agent import WAIT, Closes, FakeAgent, jupyter_msg, unchecked_frame, wait_until_stalled

pytestmark = pytest.mark.unit

RUN = "a1b2c3"


def out(data: bytes, name: Any = "stdout", run_id: Any = RUN) -> dict[str, Any]:
    return {"op": "bash_out", "run_id": run_id, "name": name, "data": data}


def texts(decoder: BashOutput, *frames: dict[str, Any]) -> list[tuple[str, str]]:
    result = []
    for frame in frames:
        message = decoder.decode(frame)
        if message is not None:
            result.append((message.content["name"], message.content["text"]))
    return result


# -- BashOutput ----------------------------------------------------------------------------------


def test_a_frame_becomes_the_stream_message_an_older_agent_sends() -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    message = decoder.decode(out(b"hello\n"))
    assert message is not None
    assert message.channel == "iopub" and message.msg_type == "stream"
    assert message.content == {"name": "stdout", "text": "hello\n"}
    assert message.parent_id == RUN
    assert message.msg["parent_header"] == {"msg_id": RUN, "msg_type": "bash_request"}
    assert message.msg["header"]["session"] == "bash"
    assert message.size >= len("hello\n")


def test_a_character_split_between_frames_is_made_whole() -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    euro = "€".encode()
    got = texts(decoder, out(b"caf\xc3"), out(b"\xa9 " + euro[:1]), out(euro[1:2]), out(euro[2:] + b"!"))
    assert got == [("stdout", "caf"), ("stdout", "é "), ("stdout", "€!")]
    assert decoder.finish(RUN) == []


def test_stdout_and_stderr_are_decoded_apart() -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    got = texts(decoder, out(b"\xc3", "stdout"), out(b"err\xe2\x82", "stderr"), out(b"\xa9", "stdout"))
    assert got == [("stderr", "err"), ("stdout", "é")]
    [tail] = decoder.finish(RUN)  # the incomplete character of stderr, at the end
    assert (tail.content["name"], tail.content["text"]) == ("stderr", "\ufffd")
    assert not decoder.expects(RUN)


def test_bytes_that_are_not_utf8_are_replaced() -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    assert texts(decoder, out(b"a\xffb\x80")) == [("stdout", "a\ufffdb\ufffd")]


def test_frames_of_a_run_not_started_here_are_dropped_and_counted() -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    assert decoder.decode(out(b"x" * 100, run_id="elsewhere")) is None
    assert decoder.decode(out(b"yy", run_id="")) is None
    assert (decoder.dropped_frames, decoder.dropped_bytes) == (2, 102)
    assert len(decoder) == 1 and not decoder.expects("elsewhere")  # no state for them
    assert decoder.finish("elsewhere") == []


@pytest.mark.parametrize(
    "frame",
    [
        out(b"x", run_id=7),
        out(b"x", run_id=None),
        out(b"x", run_id=["a"]),
        out(b"x", name="stdin"),
        out(b"x", name=None),
        out(b"x", name={"a": 1}),
        {"op": "bash_out", "run_id": RUN, "name": "stdout", "data": "text, not bytes"},
        {"op": "bash_out", "run_id": RUN, "name": "stdout"},
        out(b"x" * (BASH_OUT_MAX + 1)),
    ],
)
def test_frames_of_the_wrong_shape_are_violations(frame: dict[str, Any]) -> None:
    decoder = BashOutput()
    decoder.expect(RUN)
    with pytest.raises(ProtocolViolation):
        decoder.decode(frame)


def test_runs_are_bounded() -> None:
    decoder = BashOutput(max_runs=3)
    for run in ("r1", "r2", "r3", "r4"):
        decoder.expect(run)
    assert len(decoder) == 3 and not decoder.expects("r1") and decoder.expects("r4")


# -- AgentClient ---------------------------------------------------------------------------------


async def connected(sock_path: str, agent: FakeAgent, raw: bool, **kwargs: Any) -> tuple[AgentClient, Closes]:
    caps = ["bash", "processes"] + (["raw_output"] if raw else [])
    agent.reply_fields["hello"] = {"agent_version": 2, "capabilities": caps}
    client = AgentClient(sock_path, max_frame_bytes=2 * BASH_OUT_MAX, **kwargs)
    closes = Closes()
    client.add_listener(closes)
    await client.connect(timeout=WAIT)
    await client.hello(timeout=WAIT)
    return client, closes


async def reply(agent: FakeAgent, run_id: str, **content: Any) -> None:
    parent = {"msg_id": run_id, "msg_type": "bash_request"}
    fields = {"exit_code": 0, "signal": None, "failure": None, **content}
    await agent.emit("shell", jupyter_msg("bash_reply", fields, parent))


async def collect(sub: Any) -> list[tuple[str, str, str]]:
    got = []
    while True:
        m = await sub.get(timeout=WAIT)
        got.append((m.channel, m.msg_type, m.content.get("name", "") + ":" + m.content.get("text", "")))
        if m.msg_type == "bash_reply":
            return got


async def test_start_bash_asks_for_raw_output_and_decodes_it(sock_path: str, agent: FakeAgent) -> None:
    client, closes = await connected(sock_path, agent, raw=True)
    try:
        sub = client.subscribe(RUN)
        await client.start_bash(RUN, timeout=WAIT, command="true", max_output_bytes=10)
        [request] = agent.requests(Op.BASH)
        assert request["raw_output"] is True and request["run_id"] == RUN
        for frame in (out(b"one \xe2\x82"), out(b"oops", "stderr"), out(b"\xac two\n\xe2")):
            await agent.send(frame)
        await reply(agent, RUN)
        assert await collect(sub) == [
            ("iopub", "stream", "stdout:one "),
            ("iopub", "stream", "stderr:oops"),
            ("iopub", "stream", "stdout:€ two\n"),
            ("iopub", "stream", "stdout:\ufffd"),  # what the decoder held, before the reply
            ("shell", "bash_reply", ":"),
        ]
        await agent.send(out(b"late"))  # after its reply: dropped, not a violation
        assert (await client.request(Op.PING, timeout=WAIT))["ok"]
        assert client.bash_output.dropped_bytes == 4 and closes.calls == []
    finally:
        await client.close()


async def test_an_older_agent_gets_no_raw_output_field(sock_path: str, agent: FakeAgent) -> None:
    client, _ = await connected(sock_path, agent, raw=False)
    try:
        await client.start_bash(RUN, timeout=WAIT, command="true")
        [request] = agent.requests(Op.BASH)
        assert "raw_output" not in request
        assert not client.bash_output.expects(RUN)
    finally:
        await client.close()


async def test_a_refused_start_forgets_the_run(sock_path: str, agent: FakeAgent) -> None:
    client, closes = await connected(sock_path, agent, raw=True)
    agent.replies[Op.BASH] = "error"
    try:
        with pytest.raises(Exception, match="refuses"):
            await client.start_bash(RUN, timeout=WAIT, command="true")
        assert not client.bash_output.expects(RUN)
        await agent.send(out(b"x"))
        assert (await client.request(Op.PING, timeout=WAIT))["ok"] and closes.calls == []
    finally:
        await client.close()


async def test_frames_of_runs_it_did_not_start_reach_nobody(sock_path: str, agent: FakeAgent) -> None:
    client, closes = await connected(sock_path, agent, raw=True)
    try:
        sub = client.subscribe("python-msg-id")  # a subscription of another kind of call
        for run_id in ("python-msg-id", "other-run"):
            await agent.send(out(b"injected", run_id=run_id))
        assert (await client.request(Op.PING, timeout=WAIT))["ok"]
        assert sub.queue.empty() and closes.calls == []
        assert client.bash_output.dropped_frames == 2 and len(client.bash_output) == 0
    finally:
        await client.close()


@pytest.mark.parametrize(
    "frame",
    [
        out(b"x", run_id=1),
        out(b"x", name="stdin"),
        {"op": "bash_out", "run_id": RUN, "name": "stdout", "data": ["x"]},
        out(b"x" * (BASH_OUT_MAX + 1)),
    ],
)
async def test_a_frame_of_the_wrong_shape_cuts_the_guest_off(
    sock_path: str, agent: FakeAgent, frame: dict[str, Any]
) -> None:
    client, closes = await connected(sock_path, agent, raw=True)
    try:
        sub = client.subscribe(RUN)
        await client.start_bash(RUN, timeout=WAIT, command="true")
        await agent.send_raw(unchecked_frame(frame))
        reason, violation = await closes.wait()
        assert violation and "bash_out" in reason
        assert not client.connected and len(client.bash_output) == 0
        with pytest.raises(Exception, match="bash_out"):
            await sub.get(timeout=WAIT)
    finally:
        await client.close()


async def test_a_consumer_that_stops_reading_stops_the_reader(sock_path: str, agent: FakeAgent) -> None:
    client, closes = await connected(sock_path, agent, raw=True, queue_size=4)
    try:
        sub = client.subscribe(RUN)
        await client.start_bash(RUN, timeout=WAIT, command="true")

        async def flood() -> None:
            for _ in range(200):
                await agent.send(out(b"x" * 65536))

        task = agent.spawn(flood())
        sent = await wait_until_stalled(lambda: agent.frames_sent, task)
        assert not task.done() and sent < 200  # the guest blocks; the host holds a bounded amount
        assert sub.queue.qsize() <= 4
        for _ in range(200):
            assert (await sub.get(timeout=WAIT)).content["text"] == "x" * 65536
        await asyncio.wait_for(task, WAIT)
        assert closes.calls == []
    finally:
        await client.close()
