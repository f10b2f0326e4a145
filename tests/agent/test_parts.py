"""The agent's parts on their own, without a kernel: dispatcher, port, proxy parsing, pip.conf."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from kernelhost_agent.dispatch import Dispatcher, Handler
from kernelhost_agent.network import PIP_MARK, write_pip_conf
from kernelhost_agent.port import Port
from kernelhost_agent.tasks import TaskSet

from kernelhost.channel import protocol
from kernelhost.channel.codec import FrameDecoder, FrameError, encode_frame

from .host import WAIT

pytestmark = pytest.mark.unit


class Sent(list[dict[str, Any]]):
    """A send() that keeps what the real port would send, and refuses what it could not."""

    def __call__(self, message: dict[str, Any]) -> bool:
        try:
            encode_frame(message)
        except (FrameError, TypeError, ValueError, OverflowError):
            return False
        self.append(message)
        return True


class Area:
    capability = protocol.Capability.FILES

    def ops(self) -> Mapping[str, Handler]:
        return {"fs_stat": self.unencodable, "fs_read": self.boom}

    async def unencodable(self, frame: dict[str, Any]) -> dict[str, Any]:
        return {"value": object()}

    async def boom(self, frame: dict[str, Any]) -> dict[str, Any]:
        raise RuntimeError("bug in a handler")


async def test_a_reply_that_cannot_be_encoded_is_answered_with_an_error() -> None:
    sent, tasks = Sent(), TaskSet()
    dispatcher = Dispatcher(sent, tasks)
    dispatcher.register(Area())
    dispatcher.on_frame({"op": "fs_stat", "id": 1})
    dispatcher.on_frame({"op": "fs_read", "id": 2})
    await tasks.wait_all(WAIT)
    by_id = {m["id"]: m for m in sent}
    assert by_id[1]["ok"] is False and "could not encode its reply to fs_stat" in by_id[1]["error"]
    assert by_id[2] == {"op": "reply", "id": 2, "ok": False, "error": "RuntimeError: bug in a handler"}
    assert dispatcher.capabilities() == ["files"]
    assert tasks.failures == 0


async def test_an_op_is_registered_once() -> None:
    dispatcher = Dispatcher(Sent(), TaskSet())
    dispatcher.register(Area())
    with pytest.raises(ValueError, match="registered twice"):
        dispatcher.register(Area())


async def test_a_frame_kind_handler_that_raises_does_not_escape() -> None:
    sent = Sent()
    dispatcher = Dispatcher(sent, TaskSet())

    def broken(frame: dict[str, Any]) -> None:
        raise KeyError("t")

    dispatcher.register_kinds({"net": broken})
    dispatcher.on_frame({"op": "net"})  # logged, not raised into the port's callback
    assert sent == []


async def test_port_reassembles_frames_fed_a_byte_at_a_time() -> None:
    host, agent_end = socket.socketpair()
    got: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    port = Port(agent_end.fileno(), asyncio.get_running_loop(), got.put_nowait, owns_fd=False)
    port.start()
    try:
        for byte in encode_frame({"op": "ping", "id": 1}) + encode_frame({"op": "ping", "id": 2}):
            host.send(bytes([byte]))
        assert await asyncio.wait_for(got.get(), WAIT) == {"op": "ping", "id": 1}
        assert await asyncio.wait_for(got.get(), WAIT) == {"op": "ping", "id": 2}
        assert port.send({"op": "reply", "id": 1, "ok": True}) is True
        assert port.send({"op": "reply", "big": 2**70}) is False  # msgpack has no such integer
        host.settimeout(WAIT)
        assert FrameDecoder().feed(host.recv(1 << 16)) == [{"op": "reply", "id": 1, "ok": True}]
    finally:
        await asyncio.to_thread(port.close)
        host.close()
        agent_end.close()


def test_pip_conf_is_written_only_over_our_own(tmp_path: Path) -> None:
    conf = tmp_path / "pip.conf"
    write_pip_conf(str(conf), None, 3128)
    assert conf.read_text().startswith(PIP_MARK)
    write_pip_conf(str(conf), {"mode": "outbound", "extra-index-url": ["https://a", "https://b"]}, 4000)
    text = conf.read_text()
    assert "proxy = http://127.0.0.1:4000" in text
    assert "extra-index-url = https://a https://b" in text
    conf.write_text("[global]\n")
    write_pip_conf(str(conf), None, 3128)
    assert conf.read_text() == "[global]\n"
