"""Network modes (op net_config), pip.conf, the proxy environment, and the proxy's tunnels."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernelhost.channel import protocol

from .conftest import Running
from .host import WAIT, HostEnd

pytestmark = pytest.mark.unit

PROXY_ENV = {"HTTP_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9"}


async def net_frame(host: HostEnd, kind: str) -> dict[str, Any]:
    frame = await asyncio.wait_for(host.net.get(), WAIT)
    assert frame["t"] == kind, frame
    return frame


async def host_net(host: HostEnd, kind: str, tunnel: Any, **fields: Any) -> None:
    await host.send({"op": protocol.Frame.NET, "t": kind, "tunnel": tunnel, **fields})


@pytest.fixture
async def allowlist(host: HostEnd) -> AsyncIterator[dict[str, Any]]:
    reply = await host.ok(
        protocol.Op.NET_CONFIG,
        mode="allowlist",
        env=PROXY_ENV,
        pip={"index-url": "https://pypi.example/simple", "trusted-host": ["a.example", "bad\nline"]},
    )
    yield reply
    await host.ok(protocol.Op.NET_CONFIG, mode="none")


async def connect(running: Running) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.wait_for(asyncio.open_connection("127.0.0.1", running.config.proxy_port), WAIT)


async def test_mode_none_writes_pip_conf_and_listens_nowhere(host: HostEnd, running: Running) -> None:
    reply = await host.ok(protocol.Op.NET_CONFIG, mode="none")
    assert reply == {
        "op": "reply",
        "id": reply["id"],
        "ok": True,
        "listening": False,
        "port": running.config.proxy_port,
    }
    assert 'network mode "none"' in Path(running.config.pip_conf).read_text()
    with pytest.raises(OSError):
        await connect(running)


async def test_allowlist_sets_pip_conf_and_environment(
    host: HostEnd, running: Running, allowlist: dict[str, Any]
) -> None:
    assert allowlist["listening"] is True
    conf = Path(running.config.pip_conf).read_text()
    assert f"proxy = http://127.0.0.1:{running.config.proxy_port}" in conf
    assert "index-url = https://pypi.example/simple" in conf
    assert "trusted-host = a.example\n" in conf  # a value with a line break is left out
    run = await host.execute(
        f"import os, sys\nprint(os.environ.get('HTTP_PROXY'), {running.config.pip_site!r} in sys.path)"
    )
    assert run.stream() == "http://127.0.0.1:9 True\n"
    assert running.config.environ["https_proxy"] == "http://127.0.0.1:9"  # for later restarts
    assert "HTTP_PROXY" not in os.environ  # the test process's own environment is untouched
    from .test_bash import bash

    shell = await bash(host, 'echo "$HTTP_PROXY"')
    assert shell.streams["stdout"] == "http://127.0.0.1:9\n"


async def test_back_to_none_clears_the_environment(host: HostEnd, running: Running) -> None:
    await host.ok(protocol.Op.NET_CONFIG, mode="outbound", env=PROXY_ENV)
    await host.ok(protocol.Op.NET_CONFIG, mode="none")
    run = await host.execute("import os; print(os.environ.get('HTTP_PROXY'))")
    assert run.stream() == "None\n"
    assert "HTTP_PROXY" not in running.config.environ


async def test_a_pip_conf_of_the_users_own_is_left_alone(host: HostEnd, running: Running) -> None:
    conf = Path(running.config.pip_conf)
    conf.write_text("[global]\nindex-url = https://mine.example\n")
    try:
        await host.ok(protocol.Op.NET_CONFIG, mode="allowlist", env={})
        assert conf.read_text() == "[global]\nindex-url = https://mine.example\n"
    finally:
        conf.unlink()
        await host.ok(protocol.Op.NET_CONFIG, mode="none")


async def test_connect_tunnel(host: HostEnd, running: Running, allowlist: dict[str, Any]) -> None:
    reader, writer = await connect(running)
    writer.write(b"CONNECT pypi.example:443 HTTP/1.1\r\nHost: pypi.example:443\r\n\r\n")
    opened = await net_frame(host, "open")
    assert (opened["host"], opened["port"]) == ("pypi.example", 443)
    tunnel = opened["tunnel"]
    await host_net(host, "opened", tunnel, ok=True, status=200, error=None)
    assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT) == (
        b"HTTP/1.1 200 Connection established\r\n\r\n"
    )
    writer.write(b"client hello")
    up = await net_frame(host, "data")
    assert up["data"] == b"client hello" and up["tunnel"] == tunnel
    await host_net(host, "data", tunnel, data=b"server hello")
    assert await asyncio.wait_for(reader.readexactly(12), WAIT) == b"server hello"
    ack = await net_frame(host, "ack")
    assert ack["n"] == 12
    await host_net(host, "close", tunnel)
    assert await asyncio.wait_for(reader.read(), WAIT) == b""
    writer.close()
    assert (await net_frame(host, "close"))["tunnel"] == tunnel


async def test_plain_http_request(host: HostEnd, running: Running, allowlist: dict[str, Any]) -> None:
    _, writer = await connect(running)
    writer.write(
        b"GET http://files.example:8080/x?y=1 HTTP/1.1\r\nHost: files.example\r\n"
        b"Proxy-Connection: keep-alive\r\nAccept: */*\r\n\r\n"
    )
    opened = await net_frame(host, "open")
    assert (opened["host"], opened["port"]) == ("files.example", 8080)
    await host_net(host, "opened", opened["tunnel"], ok=True)
    head = await net_frame(host, "data")
    assert head["data"] == (
        b"GET /x?y=1 HTTP/1.1\r\nHost: files.example\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    writer.close()
    assert (await net_frame(host, "close"))["tunnel"] == opened["tunnel"]


async def test_refused_by_the_host(host: HostEnd, running: Running, allowlist: dict[str, Any]) -> None:
    reader, writer = await connect(running)
    writer.write(b"CONNECT evil.example:443 HTTP/1.1\r\n\r\n")
    opened = await net_frame(host, "open")
    await host_net(
        host, "opened", opened["tunnel"], ok=False, status=403, error="evil.example is not on the allowlist"
    )
    answer = await asyncio.wait_for(reader.read(), WAIT)
    assert answer.startswith(b"HTTP/1.1 403 evil.example is not on the allowlist\r\n")
    writer.close()
    await net_frame(host, "close")


@pytest.mark.parametrize(
    "request_head",
    [
        b"NONSENSE\r\n\r\n",
        b"GET https://x.example/ HTTP/1.1\r\n\r\n",
        b"CONNECT x.example:99999 HTTP/1.1\r\n\r\n",
        b"GET http://x.example:no/ HTTP/1.1\r\n\r\n",
    ],
)
async def test_bad_requests_get_400(running: Running, allowlist: dict[str, Any], request_head: bytes) -> None:
    reader, writer = await connect(running)
    writer.write(request_head)
    answer = await asyncio.wait_for(reader.read(), WAIT)
    assert answer.startswith(b"HTTP/1.1 400 kernelhost proxy: ")
    writer.close()


async def test_frames_for_unknown_tunnels_are_answered_with_close(host: HostEnd) -> None:
    await host_net(host, "data", 999_999, data=b"x")
    assert (await net_frame(host, "close"))["tunnel"] == 999_999
    await host_net(host, "close", 999_998)  # a close is not answered
    await host_net(host, "ack", "not-an-id", n=1)  # neither is a frame without an integer id
    await host.ping_until_answered()
    assert host.net.empty()


async def test_net_config_drops_the_tunnels_of_an_earlier_host(
    host: HostEnd, running: Running, allowlist: dict[str, Any]
) -> None:
    reader, writer = await connect(running)
    writer.write(b"CONNECT slow.example:443 HTTP/1.1\r\n\r\n")
    await net_frame(host, "open")
    await host.ok(protocol.Op.NET_CONFIG, mode="allowlist", env=PROXY_ENV)
    answer = await asyncio.wait_for(reader.read(), WAIT)
    assert answer.startswith(b"HTTP/1.1 502 the host reconnected; retry")
    writer.close()


# -- ingress: the host's connections to a port in the guest ------------------------------------------


async def test_the_host_connects_to_a_port_a_server_in_the_guest_listens_on(host: HostEnd) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"echo:" + await reader.readexactly(5))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await host_net(host, protocol.NetFrame.CONNECT, -1, port=port)
        assert (await net_frame(host, protocol.NetFrame.OPENED))["ok"] is True
        await host_net(host, protocol.NetFrame.DATA, -1, data=b"hello")
        got = b""
        while True:
            frame = await asyncio.wait_for(host.net.get(), WAIT)
            if frame["t"] == protocol.NetFrame.DATA:
                got += frame["data"]
            elif frame["t"] == protocol.NetFrame.CLOSE:
                break
        assert got == b"echo:hello"
    finally:
        server.close()


async def test_a_connect_to_a_port_nothing_listens_on_is_answered_with_the_reason(host: HostEnd) -> None:
    with socket_bound() as port:  # bound, not listening: the connection is refused
        await host_net(host, protocol.NetFrame.CONNECT, -2, port=port)
        opened = await net_frame(host, protocol.NetFrame.OPENED)
    assert opened["ok"] is False
    assert f"nothing in the sandbox accepts connections on port {port}" in opened["error"]
    await host_net(host, protocol.NetFrame.CONNECT, -3, port=70000)
    assert "no such port" in (await net_frame(host, protocol.NetFrame.OPENED))["error"]


@contextlib.contextmanager
def socket_bound() -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
