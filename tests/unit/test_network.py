"""Per-sandbox network (kernelhost/sandboxes/network/): entries, requests, the policy and its
host protection, the host's pip configuration, the tunnel's flow control and cleanup against
the fake agent on a real channel, and the package-index server the tunnels reach."""

from __future__ import annotations

import asyncio
import ipaddress
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from kernelhost.api.pip_index import serving as serving_index
from kernelhost.channel import AgentClient
from kernelhost.channel.protocol import NET_WINDOW as WINDOW
from kernelhost.config import ConfigError, Settings
from kernelhost.pipconfig import PipIndexes, read_pip_config
from kernelhost.sandboxes import InvalidRequest
from kernelhost.sandboxes.network import (
    INDEX_HOST,
    MAX_TUNNELS,
    HostNetwork,
    NetworkSpec,
    Refused,
    Tunnels,
    parse_entry,
    parse_network,
)
from kernelhost.sandboxes.store.sandboxes import Store

from .fake_agent import WAIT, FakeAgent

pytestmark = pytest.mark.unit

OWN = {ipaddress.ip_address("192.0.2.2")}


def host_network(
    tmp_path: Path, allow: tuple[str, ...] = (), pip: PipIndexes | None = None, port: int = 8999
) -> HostNetwork:
    settings = Settings(state_dir=tmp_path, network_allow=allow, port=port)
    return HostNetwork(settings, pip=pip or PipIndexes(), own_addresses=set(OWN))


# -- entries and requests --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, host, port",
    [
        ("Example.ORG", "example.org", None),
        ("example.org:8443", "example.org", 8443),
        ("*.example.org", "*.example.org", None),
        ("10.1.2.3:80", "10.1.2.3", 80),
        ("[::1]:443", "::1", 443),
        ("::1", "::1", None),
        ("example.org.", "example.org", None),
    ],
)
def test_entries_parse(text: str, host: str, port: int | None) -> None:
    entry = parse_entry(text)
    assert (entry.host, entry.port) == (host, port)


@pytest.mark.parametrize(
    "text",
    ["", "a b", "host:0", "host:99999", "host:", "http://x/", "*.", "[::1", 5, "x" * 400, "ex*mple.org"],
)
def test_bad_entries_name_the_value_and_the_shape(text: Any) -> None:
    with pytest.raises(ValueError, match="allow entry") as info:
        parse_entry(text)
    assert "host:port" in str(info.value) or "1-65535" in str(info.value)


def test_network_requests() -> None:
    assert parse_network(None) == NetworkSpec("none")
    assert parse_network("outbound") == NetworkSpec("outbound")
    spec = parse_network({"mode": "allowlist", "allow": ["A.example:443", "a.example:443"]})
    assert spec.to_dict() == {"mode": "allowlist", "allow": ["a.example:443"]}
    assert NetworkSpec.from_dict(spec.to_dict()) == spec
    assert NetworkSpec.from_dict({"mode": "bogus"}) == NetworkSpec("none")
    for bad, fieldname, words in [
        ("open", "network.mode", "'open'"),
        (5, "network", "5"),
        ({"mode": "outbound", "allow": ["x:1"]}, "network.allow", "'allowlist' only"),
        ({"mode": "allowlist", "allow": ["bad host"]}, "network.allow", "'bad host'"),
        ({"mode": "allowlist", "allow": "x"}, "network.allow", "list"),
        ({"mode": "none", "proxy": 1}, "network", "proxy"),
    ]:
        with pytest.raises(InvalidRequest) as info:
            parse_network(bad)
        assert info.value.details["field"] == fieldname and words in str(info.value), str(info.value)


# -- policy and host protection --------------------------------------------------------------------


async def test_allowlist_matches_names_ports_and_wildcards(tmp_path: Path) -> None:
    net = host_network(tmp_path, pip=PipIndexes("https://index.example:8443/simple"))
    policy = net.policy(parse_network({"mode": "allowlist", "allow": ["*.files.example", "8.8.8.8:22"]}))

    async def ok(host: str, port: int) -> bool:
        try:
            await policy.resolve(host, port)
        except Refused as exc:
            return "allowlist" not in str(exc)  # past the list, stopped later (no DNS here)
        return True

    assert await ok("INDEX.example", 8443)  # the host's pip index, case-insensitive
    assert not await ok("index.example", 443)
    assert await ok("a.files.example", 443) and await ok("b.a.files.example", 80)
    assert not await ok("files.example", 443) and not await ok("a.files.example", 8080)
    assert await ok("8.8.8.8", 22) and not await ok("8.8.4.4", 22)
    with pytest.raises(Refused, match="not in this sandbox's network allowlist"):
        await policy.resolve("example.com", 443)


async def test_none_refuses_everything(tmp_path: Path) -> None:
    policy = host_network(tmp_path).policy(NetworkSpec("none"))
    with pytest.raises(Refused, match="network mode none"):
        await policy.resolve("8.8.8.8", 443)
    assert policy.local_endpoint(INDEX_HOST, 80) is None


@pytest.mark.parametrize(
    "addr, why",
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("169.254.169.254", "link-local"),
        ("10.0.0.5", "private"),
        ("192.168.1.1", "private"),
        ("192.0.2.2", "host itself"),
        ("::ffff:127.0.0.1", "loopback"),
        ("0.0.0.0", "unicast"),
        ("fe80::1", "link-local"),
    ],
)
async def test_outbound_refuses_protected_addresses(tmp_path: Path, addr: str, why: str) -> None:
    policy = host_network(tmp_path).policy(NetworkSpec("outbound"))
    with pytest.raises(Refused, match=why):
        await policy.resolve(addr, 443)
    assert await policy.resolve("8.8.8.8", 443) == [ipaddress.ip_address("8.8.8.8")]


async def test_localhost_by_name_is_refused(tmp_path: Path) -> None:
    policy = host_network(tmp_path).policy(NetworkSpec("outbound"))
    with pytest.raises(Refused, match="loopback"):
        await policy.resolve("localhost", 80)


async def test_only_the_operator_lifts_the_protection_and_never_for_the_api(tmp_path: Path) -> None:
    net = host_network(tmp_path, allow=("10.0.0.5:3141", "127.0.0.1"), port=8999)
    for mode in ("allowlist", "outbound"):
        policy = net.policy(NetworkSpec(mode))
        assert await policy.resolve("10.0.0.5", 3141) == [ipaddress.ip_address("10.0.0.5")]
    # a tenant's entry for the same private address does not
    tenant = host_network(tmp_path).policy(parse_network({"mode": "allowlist", "allow": ["10.0.0.5:3141"]}))
    with pytest.raises(Refused, match="private"):
        await tenant.resolve("10.0.0.5", 3141)
    # the service's own API stays closed even to an operator-listed loopback
    with pytest.raises(Refused, match="kernelhost API"):
        await net.policy(NetworkSpec("outbound")).resolve("127.0.0.1", 8999)
    assert await net.policy(NetworkSpec("outbound")).resolve("127.0.0.1", 80)


def test_bad_operator_entries_fail_at_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="network_allow"):
        host_network(tmp_path, allow=("not a host",))


# -- the host's pip configuration ------------------------------------------------------------------


def test_pip_config_files_and_environment(tmp_path: Path) -> None:
    first, second = tmp_path / "a.conf", tmp_path / "b.conf"
    first.write_text(
        "[global]\nindex-url = https://one.example/simple\nextra-index-url = https://x.example/simple\n"
    )
    second.write_text(
        "[install]\nextra-index-url =\n  file:///srv/idx/simple\n  http://mirror.example:3141/root/simple\n"
    )
    pip = read_pip_config({}, [first, second, tmp_path / "missing.conf"])
    assert pip.index_url == "https://one.example/simple"
    assert pip.extra_index_urls == ["file:///srv/idx/simple", "http://mirror.example:3141/root/simple"]
    env = read_pip_config({"PIP_INDEX_URL": "https://env.example/simple"}, [first])
    assert env.index_url == "https://env.example/simple"


def test_guest_pip_settings_and_default_allowlist(tmp_path: Path) -> None:
    local = tmp_path / "pypi" / "simple"
    local.mkdir(parents=True)
    net = host_network(
        tmp_path,
        pip=PipIndexes(
            None, [local.as_uri(), "http://mirror.example:3141/root/simple", "file:///no/such/dir"]
        ),
    )
    assert net.guest_pip == {
        "index-url": f"http://{INDEX_HOST}/0/simple/",
        "extra-index-url": ["http://mirror.example:3141/root/simple"],
        "trusted-host": sorted([INDEX_HOST, "mirror.example"]),
    }
    assert net.file_roots == [tmp_path / "pypi"]
    assert [str(e) for e in net.defaults] == ["mirror.example:3141"]
    config = net.guest_config(NetworkSpec("allowlist"))
    assert config["env"]["HTTPS_PROXY"] == "http://127.0.0.1:3128"
    assert net.guest_config(NetworkSpec("none")) == {"mode": "none", "env": {}, "pip": None}
    net.index_endpoint = tmp_path / "index.sock"
    assert net.policy(NetworkSpec("allowlist")).local_endpoint(INDEX_HOST, 80) == tmp_path / "index.sock"
    assert net.policy(NetworkSpec("none")).local_endpoint(INDEX_HOST, 80) is None


def test_old_databases_gain_the_network_column(tmp_path: Path) -> None:
    path = tmp_path / "old.sqlite3"
    db = sqlite3.connect(path)
    db.execute(
        "CREATE TABLE sandboxes (id TEXT PRIMARY KEY, owner TEXT NOT NULL, template TEXT "
        "NOT NULL, domain TEXT NOT NULL UNIQUE, state TEXT NOT NULL, created_at REAL NOT "
        "NULL, last_active_at REAL NOT NULL, idle_timeout_seconds INTEGER NOT NULL, "
        "memory_mib INTEGER NOT NULL, vcpus INTEGER NOT NULL, accel TEXT NOT NULL, "
        "image_key TEXT NOT NULL, metadata TEXT NOT NULL DEFAULT '{}', detail TEXT NOT "
        "NULL DEFAULT '')"
    )
    db.execute(
        "INSERT INTO sandboxes VALUES ('sbx_1', 'k', 'python', 'd1', 'running', 1, 1, "
        "600, 512, 1, 'tcg', 'k1', '{}', '')"
    )
    db.commit()
    db.close()
    store = Store(path)
    [rec] = store.all()
    assert rec.network == {"mode": "none", "allow": []}
    store.update(rec.id, network={"mode": "outbound", "allow": []})
    assert store.get(rec.id).network["mode"] == "outbound"  # type: ignore[union-attr]
    store.close()


# -- tunnels over a real channel ---------------------------------------------------------------------


class Remote:
    """A TCP server on 127.0.0.1: echoes, or sends ``flood`` bytes; records what it saw."""

    def __init__(self, flood: int = 0) -> None:
        self.flood = flood
        self.closed = asyncio.Event()
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> Remote:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self.flood:
                writer.write(b"x" * self.flood)
                await writer.drain()
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self.closed.set()
            writer.close()

    def close(self) -> None:
        assert self.server is not None
        self.server.close()


async def tunnels_for(
    agent: FakeAgent,
    sock_path: str,
    tmp_path: Path,
    mode: str,
    allow: tuple[str, ...] = (),
    counts: list[str] | None = None,
) -> tuple[AgentClient, Tunnels]:
    client = AgentClient(sock_path)
    await client.connect(timeout=WAIT)
    net = host_network(tmp_path, allow=allow)
    tunnels = Tunnels(
        net.policy(NetworkSpec(mode)), client, "sbx_test", count=None if counts is None else counts.append
    )
    client.add_listener(tunnels)
    return client, tunnels


def net_frames(agent: FakeAgent, kind: str, tunnel: int = 1) -> list[dict[str, Any]]:
    return [
        f for f in agent.received if f["op"] == "net" and f.get("t") == kind and f.get("tunnel") == tunnel
    ]


async def test_tunnel_echoes_and_respects_the_window(
    agent: FakeAgent, sock_path: str, tmp_path: Path
) -> None:
    remote = await Remote(flood=4 * WINDOW).start()
    client, tunnels = await tunnels_for(
        agent, sock_path, tmp_path, "outbound", allow=(f"127.0.0.1:{remote.port}",)
    )
    try:
        await agent.send({"op": "net", "t": "open", "tunnel": 1, "host": "127.0.0.1", "port": remote.port})
        opened = await agent.wait_for_frame(lambda f: f.get("t") == "opened")
        assert opened["ok"] is True, opened

        def received() -> int:
            return sum(len(f["data"]) for f in net_frames(agent, "data"))

        # the guest acknowledges nothing: the host sends one window and stops reading
        await agent.wait_until(lambda: received() >= WINDOW)
        await asyncio.sleep(0.3)
        assert received() == WINDOW
        await agent.send({"op": "net", "t": "ack", "tunnel": 1, "n": WINDOW})
        await agent.wait_until(lambda: received() >= 2 * WINDOW)
        await asyncio.sleep(0.2)
        assert received() == 2 * WINDOW
        # guest -> remote: written out, then acknowledged
        await agent.send({"op": "net", "t": "data", "tunnel": 1, "data": b"ping"})
        await agent.wait_for_frame(lambda f: f.get("t") == "ack" and f.get("n") == 4)
        # a guest that ignores the window loses the tunnel
        await agent.send({"op": "net", "t": "data", "tunnel": 1, "data": b"y" * (WINDOW + 1)})
        await asyncio.wait_for(remote.closed.wait(), WAIT)
        await agent.wait_for_frame(lambda f: f.get("t") == "close")
        assert not tunnels.tunnels
    finally:
        await tunnels.aclose()
        await client.close()
        remote.close()


async def test_close_ends_every_tunnel(agent: FakeAgent, sock_path: str, tmp_path: Path) -> None:
    remote = await Remote().start()
    client, tunnels = await tunnels_for(
        agent, sock_path, tmp_path, "outbound", allow=(f"127.0.0.1:{remote.port}",)
    )
    try:
        await agent.send({"op": "net", "t": "open", "tunnel": 7, "host": "127.0.0.1", "port": remote.port})
        await agent.wait_for_frame(lambda f: f.get("t") == "opened" and f["ok"])
        assert tunnels.tasks
        await client.close()  # what hibernation, replacement and delete do
        tunnels.close()
        await asyncio.wait_for(remote.closed.wait(), WAIT)
        await asyncio.sleep(0)
        assert not tunnels.tunnels
        await asyncio.wait_for(tunnels.tasks.close(), WAIT)
        assert not tunnels.tasks
    finally:
        await tunnels.aclose()
        remote.close()


async def test_refusals_and_the_tunnel_cap(agent: FakeAgent, sock_path: str, tmp_path: Path) -> None:
    counts: list[str] = []
    client, tunnels = await tunnels_for(agent, sock_path, tmp_path, "allowlist", counts=counts)
    remote = await Remote().start()
    try:
        await agent.send({"op": "net", "t": "open", "tunnel": 1, "host": "127.0.0.1", "port": 8999})
        refused = await agent.wait_for_frame(lambda f: f.get("t") == "opened")
        assert refused["ok"] is False and refused["reason"] == "policy"
        assert "allowlist" in refused["error"]
        assert counts == ["refused"] and not tunnels.tunnels
        # unknown tunnels' data is answered with close; nothing is kept
        await agent.send({"op": "net", "t": "data", "tunnel": 99, "data": b"x"})
        await agent.wait_for_frame(lambda f: f.get("t") == "close" and f["tunnel"] == 99)
        # the cap: tunnels that stay open (their opens hang on a slow policy) count
        gate = asyncio.Event()

        async def slow(host: str, port: int) -> list[Any]:
            await gate.wait()
            raise Refused("late")

        tunnels.policy.resolve = slow  # type: ignore[method-assign]
        for n in range(10, 10 + MAX_TUNNELS + 1):
            await agent.send({"op": "net", "t": "open", "tunnel": n, "host": "a.example", "port": 443})
        capped = await agent.wait_for_frame(
            lambda f: f.get("t") == "opened" and f["tunnel"] == 10 + MAX_TUNNELS
        )
        assert capped["reason"] == "busy" and str(MAX_TUNNELS) in capped["error"]
        assert len(tunnels.tunnels) == MAX_TUNNELS
        gate.set()
    finally:
        await tunnels.aclose()
        await client.close()
        remote.close()


async def test_file_index_is_served_read_only(agent: FakeAgent, sock_path: str, tmp_path: Path) -> None:
    root = tmp_path / "pypi"
    (root / "simple" / "six").mkdir(parents=True)
    (root / "simple" / "six" / "index.html").write_text("<a href='../../files/six.whl'>six</a>")
    (root / "files").mkdir()
    (root / "files" / "six.whl").write_bytes(b"W" * 1000)
    (tmp_path / "secret").write_text("no")
    client = AgentClient(sock_path)
    await client.connect(timeout=WAIT)
    net = HostNetwork(
        Settings(state_dir=tmp_path), pip=PipIndexes((root / "simple").as_uri()), own_addresses=set(OWN)
    )
    tunnels = Tunnels(net.policy(NetworkSpec("allowlist")), client, "sbx_test")
    client.add_listener(tunnels)

    async def get(tunnel: int, path: str) -> bytes:
        await agent.send({"op": "net", "t": "open", "tunnel": tunnel, "host": INDEX_HOST, "port": 80})
        # as the guest's proxy forwards a request: absolute URL made relative, connection: close
        await agent.send(
            {
                "op": "net",
                "t": "data",
                "tunnel": tunnel,
                "data": (f"GET {path} HTTP/1.1\r\nHost: {INDEX_HOST}\r\nConnection: close\r\n\r\n").encode(),
            }
        )
        await agent.wait_for_frame(lambda f: f.get("t") == "close" and f["tunnel"] == tunnel)
        return b"".join(f["data"] for f in net_frames(agent, "data", tunnel))

    try:
        async with serving_index(net.file_roots) as endpoint:
            net.index_endpoint = endpoint
            page = await get(1, "/0/simple/six/")
            assert page.startswith(b"HTTP/1.1 200") and page.endswith(b"six</a>")
            assert b"Content-Type: text/html" in page
            wheel = await get(2, "/0/files/six.whl")
            assert b"Content-Length: 1000" in wheel and wheel.endswith(b"W" * 1000)
            assert (await get(3, "/0/../secret")).startswith(b"HTTP/1.1 404")
            assert (await get(4, "/0/%2e%2e/secret")).startswith(b"HTTP/1.1 404")
            assert (await get(5, "/1/simple/")).startswith(b"HTTP/1.1 404")
        assert not endpoint.exists()
        refused = await get_refused(agent, 6)
        assert refused["reason"] == "unreachable"  # the index server is gone
    finally:
        await tunnels.aclose()
        await client.close()


async def get_refused(agent: FakeAgent, tunnel: int) -> dict[str, Any]:
    await agent.send({"op": "net", "t": "open", "tunnel": tunnel, "host": INDEX_HOST, "port": 80})
    return await agent.wait_for_frame(lambda f: f.get("t") == "opened" and f["tunnel"] == tunnel)
