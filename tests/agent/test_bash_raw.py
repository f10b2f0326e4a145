"""Bash output as raw ``bash_out`` frames (``raw_output: true``): bytes spliced from the command's
pipes to the port, decoded by the host's own ``BashOutput`` here as the service decodes them."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any

import pytest

from kernelhost.channel import protocol
from kernelhost.channel.bash_output import BashOutput

from .host import WAIT, HostEnd

pytestmark = pytest.mark.unit

FRAME_KEYS = {"op", "run_id", "name", "data"}


@dataclass
class RawRun:
    run_id: str
    pid: int
    frames: list[dict[str, Any]] = field(default_factory=list)  # bash_out, in arrival order
    streams: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    reply: dict[str, Any] = field(default_factory=dict)

    def raw(self, name: str) -> bytes:
        return b"".join(f["data"] for f in self.frames if f["name"] == name)


async def start(host: HostEnd, command: str, **fields: Any) -> RawRun:
    run_id = uuid.uuid4().hex
    host.sent_parents.add(run_id)
    reply = await host.ok(protocol.Op.BASH, run_id=run_id, command=command, raw_output=True, **fields)
    return RawRun(run_id, reply["pid"])


async def finish(host: HostEnd, run: RawRun, timeout: float = WAIT) -> RawRun:
    """Collect the run's bash_out frames up to its bash_reply, decoded as the host decodes them;
    no stream message may come in raw mode."""
    decoder = BashOutput()
    decoder.expect(run.run_id)
    while not run.reply:
        channel, item = await host.next_message(run.run_id, timeout)
        if channel == "bash_out":
            assert set(item) == FRAME_KEYS and item["run_id"] == run.run_id, item
            assert isinstance(item["data"], bytes) and 0 < len(item["data"]) <= protocol.BASH_OUT_MAX
            run.frames.append(item)
            message = decoder.decode(item)
        else:
            assert (channel, item["header"]["msg_type"]) == ("shell", "bash_reply"), item
            run.reply = item["content"]
            for message in decoder.finish(run.run_id):
                run.streams[message.content["name"]] += message.content["text"]
            continue
        if message is not None:
            run.streams[message.content["name"]] += message.content["text"]
    return run


async def bash(host: HostEnd, command: str, **fields: Any) -> RawRun:
    return await finish(host, await start(host, command, **fields))


async def test_the_capability_is_announced(host: HostEnd) -> None:
    caps = (await host.ok(protocol.Op.HELLO))["capabilities"]
    assert protocol.Capability.RAW_OUTPUT in caps


async def test_output_comes_as_raw_frames(host: HostEnd) -> None:
    run = await bash(host, "printf hello; printf oops >&2; exit 4")
    assert run.raw("stdout") == b"hello" and run.raw("stderr") == b"oops"
    assert run.streams == {"stdout": "hello", "stderr": "oops"}
    assert run.reply["exit_code"] == 4 and run.reply["failure"] is None


async def test_a_large_output_arrives_whole_in_bounded_frames(host: HostEnd) -> None:
    run = await bash(host, "seq 1 400000")
    expected = "".join(f"{i}\n" for i in range(1, 400001))
    assert run.streams["stdout"] == expected
    assert len(run.frames) >= len(expected) // protocol.BASH_OUT_MAX  # no frame over the max


async def test_output_is_capped_and_the_command_still_ends(host: HostEnd) -> None:
    run = await bash(host, "head -c 5000000 /dev/zero | tr '\\0' x; echo done >&2", max_output_bytes=5)
    assert run.raw("stdout") + run.raw("stderr") == b"xxxxxx"  # the cap and one more
    assert run.reply["exit_code"] == 0  # drained past the cap: the 5 MB did not block it


async def test_a_character_split_between_frames_is_made_whole(host: HostEnd) -> None:
    command = r"printf 'caf\xc3'; sleep 0.3; printf '\xa9 \xe2\x82'; sleep 0.3; printf '\xac!\xff'"
    run = await bash(host, command)
    assert run.raw("stdout") == "café €!".encode() + b"\xff"
    assert len(run.frames) >= 3  # the pauses cut the output where the characters are split
    assert run.streams["stdout"] == "café €!\ufffd"


async def test_an_incomplete_character_at_the_end_is_replaced(host: HostEnd) -> None:
    run = await bash(host, r"printf 'x\xe2\x82'")
    assert run.streams["stdout"] == "x\ufffd"


async def test_stdout_and_stderr_keep_their_own_order(host: HostEnd) -> None:
    command = "for i in 1 2 3 4; do echo out$i; echo err$i >&2; sleep 0.05; done"
    run = await bash(host, command)
    assert run.streams["stdout"] == "out1\nout2\nout3\nout4\n"
    assert run.streams["stderr"] == "err1\nerr2\nerr3\nerr4\n"
    names = [f["name"] for f in run.frames]
    assert names.count("stdout") >= 2 and names.count("stderr") >= 2  # interleaved, not batched
    assert names.index("stderr") < len(names) - 1 - names[::-1].index("stdout")


async def test_a_background_job_does_not_hold_the_reply(host: HostEnd) -> None:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    run = await bash(host, "sleep 2 & echo fg")
    assert run.streams["stdout"] == "fg\n" and run.reply["exit_code"] == 0
    assert loop.time() - t0 < 1.5


async def test_a_command_with_stdin_and_raw_output(host: HostEnd) -> None:
    run = await start(host, 'read -r line; echo "got $line"', stdin=True)
    await host.ok(protocol.Op.BASH_INPUT, run_id=run.run_id, data=b"one\n", eof=True)
    assert (await finish(host, run)).streams["stdout"] == "got one\n"


@pytest.mark.parametrize("value", [1, "yes", None, [True]])
async def test_raw_output_must_be_a_boolean(host: HostEnd, value: Any) -> None:
    error = await host.refused(protocol.Op.BASH, run_id=uuid.uuid4().hex, command="true", raw_output=value)
    assert "raw_output" in error


async def test_without_raw_output_the_stream_messages_stay(host: HostEnd) -> None:
    run_id = uuid.uuid4().hex
    host.sent_parents.add(run_id)
    await host.ok(protocol.Op.BASH, run_id=run_id, command="echo old", raw_output=False)
    channel, msg = await host.next_message(run_id)
    assert (channel, msg["header"]["msg_type"], msg["content"]["text"]) == ("iopub", "stream", "old\n")
    channel, msg = await host.next_message(run_id)
    assert msg["header"]["msg_type"] == "bash_reply"
