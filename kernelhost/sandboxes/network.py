"""Per-sandbox network (docs/network.md): the policy and the host side of the TCP tunnel.

A guest never has a network interface. In modes ``allowlist`` and ``outbound`` its agent runs an
HTTP proxy on 127.0.0.1:3128 and asks the host, over the channel, to open each connection
(``{"op": "net", "t": "open", "tunnel": N, "host": H, "port": P}``). This module decides (the
policy), connects with a deadline and pumps bytes both ways with per-tunnel windows (``data`` /
``ack`` frames): neither side sends more than ``WINDOW`` unacknowledged bytes of a tunnel, so a
slow reader on either end never grows host memory. The host's own addresses, loopback, link-local
and private ranges are refused unless the operator listed that host explicitly, and the service's
own API port always is: an escaped or hostile guest must not reach the kernelhost API or libvirt.

Package indexes the host's pip uses that are local directories (``file://``) are served, read
only, under the virtual origin ``http://INDEX_HOST/<n>/``; nothing else of the host's disk is.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ..channel import AgentClient, ChannelClosed
from ..config import ConfigError, Settings
from .errors import InvalidRequest

log = structlog.get_logger("kernelhost.network")

MODES = ("none", "allowlist", "outbound")
MAX_TUNNELS = 32  # connections open at once per sandbox
WINDOW = 256 * 1024  # unacknowledged bytes per tunnel and direction (the guest uses the same)
CHUNK = 64 * 1024
CONNECT_TIMEOUT = 10.0  # seconds for name resolution plus the TCP connect
MAX_ALLOW = 64  # entries a create request may add
PROXY_PORT = 3128  # where the guest's proxy listens
INDEX_HOST = "pip-index.kernelhost.internal"  # virtual origin of the host's file:// indexes
_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


# -- policy ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllowEntry:
    """``host[:port]``: a name (``*.example.org`` for its subdomains) or an IP; no port: 80, 443."""

    host: str
    port: int | None = None
    operator: bool = False  # listed by the operator: may lift the private-address protection

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches(self, host: str, port: int) -> bool:
        if (port not in (80, 443)) if self.port is None else port != self.port:
            return False
        if self.wildcard:
            return host.endswith(self.host[1:])
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"


def parse_entry(text: Any, operator: bool = False) -> AllowEntry:
    """Parse ``host``, ``host:port``, ``*.domain[:port]``, ``1.2.3.4[:port]``, ``[::1][:port]``;
    ValueError names the bad value and the expected shape."""
    shape = ("use 'host', 'host:port', '*.example.org[:port]' or an IP address "
             "('[v6]:port' for IPv6 with a port)")
    if not isinstance(text, str) or not text.strip() or len(text) > 300:
        raise ValueError(f"allow entry {text!r:.80} is not a string of 1-300 characters; {shape}")
    raw = text.strip().lower()
    host, port_text = raw, ""
    if raw.startswith("["):
        inner, sep, tail = raw[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            raise ValueError(f"allow entry {text!r} is not valid; {shape}")
        host, port_text = inner, tail[1:]
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
    port: int | None = None
    if port_text or raw.endswith(":"):
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"allow entry {text!r} has port {port_text!r}; use 1-65535")
        port = int(port_text)
    host = host.rstrip(".")
    try:
        host = str(ipaddress.ip_address(host))
    except ValueError:
        if not _HOSTNAME.match(host) or len(host) > 253:
            raise ValueError(f"allow entry {text!r} is not a host name or IP address; "
                             f"{shape}") from None
    return AllowEntry(host, port, operator)


@dataclass(frozen=True)
class NetworkSpec:
    """What a sandbox asked for: its mode and the extra allowlist entries of its create call."""

    mode: str = "none"
    allow: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "allow": list(self.allow)}

    @classmethod
    def from_dict(cls, data: Any) -> NetworkSpec:
        """From a stored record (trusted shape; anything odd means ``none``)."""
        if not isinstance(data, dict) or data.get("mode") not in MODES:
            return cls()
        allow = data.get("allow")
        return cls(str(data["mode"]),
                   tuple(str(a) for a in allow) if isinstance(allow, list) else ())


def parse_network(value: Any) -> NetworkSpec:
    """The ``network`` field of a create request: a mode name, or ``{"mode", "allow"}``."""
    fix = ('give "none", "allowlist" or "outbound", or {"mode": "allowlist", "allow": '
           '["host:port", ...]}; see docs/network.md')
    if value is None:
        return NetworkSpec()
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, dict):
        raise InvalidRequest(f"field 'network' is {value!r:.80}; {fix}", field="network")
    unknown = set(value) - {"mode", "allow"}
    if unknown:
        raise InvalidRequest(f"field 'network' has unknown keys {sorted(unknown)}; {fix}",
                             field="network")
    mode = value.get("mode", "none")
    if mode not in MODES:
        raise InvalidRequest(f"network mode {mode!r} is not one of none, allowlist, outbound; "
                             f"{fix}", field="network.mode")
    allow = value.get("allow") or []
    if not isinstance(allow, list) or len(allow) > MAX_ALLOW:
        raise InvalidRequest(f"network.allow must be a list of at most {MAX_ALLOW} entries "
                             "('host[:port]')", field="network.allow")
    if allow and mode != "allowlist":
        raise InvalidRequest(f"network.allow applies to mode 'allowlist' only, not {mode!r}; "
                             "drop it or set mode to allowlist", field="network.allow")
    entries = []
    for item in allow:
        try:
            entries.append(str(parse_entry(item)))
        except ValueError as exc:
            raise InvalidRequest(f"network.allow: {exc}", field="network.allow") from None
    return NetworkSpec(mode, tuple(dict.fromkeys(entries)))


class Refused(Exception):
    """A connection the policy or the destination refused; the message is shown to the guest."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.status = status


# -- the host's pip configuration ------------------------------------------------------------------


@dataclass
class PipIndexes:
    index_url: str | None = None
    extra_index_urls: list[str] = field(default_factory=list)


def pip_config_files(environ: Mapping[str, str]) -> list[Path]:
    """pip's configuration files, in the order pip loads them (later ones override)."""
    xdg_dirs = environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in reversed(xdg_dirs.split(":")) if d]
    files.append(Path("/etc/pip.conf"))
    home = Path(environ.get("HOME") or Path.home())
    files.append(home / ".pip" / "pip.conf")
    files.append(Path(environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf")
    if environ.get("VIRTUAL_ENV"):
        files.append(Path(environ["VIRTUAL_ENV"]) / "pip.conf")
    if environ.get("PIP_CONFIG_FILE"):
        files.append(Path(environ["PIP_CONFIG_FILE"]))
    return files


def read_pip_config(environ: Mapping[str, str] | None = None,
                    files: Sequence[Path] | None = None) -> PipIndexes:
    """index-url and extra-index-url as the host's pip sees them: its config files ([global],
    then [install]) and then ``PIP_INDEX_URL`` / ``PIP_EXTRA_INDEX_URL``."""
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    for path in pip_config_files(env) if files is None else files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            log.warning("network.pip_config_unreadable", path=str(path), error=str(exc))
            continue
        for section in ("global", "install"):
            if parser.has_section(section):
                for key in ("index-url", "extra-index-url"):
                    if parser.has_option(section, key):
                        values[key] = parser.get(section, key)
    for key, name in (("index-url", "PIP_INDEX_URL"), ("extra-index-url", "PIP_EXTRA_INDEX_URL")):
        if env.get(name):
            values[key] = env[name]
    index = values.get("index-url", "").strip() or None
    return PipIndexes(index, values.get("extra-index-url", "").split())


# -- the host: defaults, protection, guest configuration ------------------------------------------


def host_addresses() -> set[IPAddress]:
    """Every address of this host's interfaces (IPv4 via SIOCGIFADDR, IPv6 from /proc)."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
                found.add(ipaddress.IPv4Address(packed[20:24]))
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as f:
        for line in f:
            found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
    return found


def _plain(addr: IPAddress) -> IPAddress:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class HostNetwork:
    """What every sandbox's policy starts from: the host's pip indexes (the default allowlist),
    the operator's ``network_allow`` entries, the host's own addresses and the API endpoint."""

    def __init__(self, settings: Settings, environ: Mapping[str, str] | None = None,
                 pip: PipIndexes | None = None,
                 own_addresses: set[IPAddress] | None = None) -> None:
        self.settings = settings
        self.own = {_plain(a) for a in (host_addresses() if own_addresses is None
                                        else own_addresses)}
        self.operator: list[AllowEntry] = []
        for text in settings.network_allow:
            try:
                self.operator.append(parse_entry(text, operator=True))
            except ValueError as exc:
                raise ConfigError(f"setting network_allow (KERNELHOST_NETWORK_ALLOW): {exc}") \
                    from None
        self.pip = read_pip_config(environ) if pip is None else pip
        self.defaults: list[AllowEntry] = []
        self.file_roots: list[Path] = []
        guest_urls = [self._guest_url(u) for u in
                      ([self.pip.index_url] if self.pip.index_url else []) + self.pip.extra_index_urls]
        urls = [u for u in guest_urls if u]
        trusted = sorted({urllib.parse.urlsplit(u).hostname or "" for u in urls
                          if u.startswith("http://")} - {""})
        self.guest_pip: dict[str, Any] = {}
        if urls:
            self.guest_pip = {"index-url": urls[0], "extra-index-url": urls[1:],
                              "trusted-host": trusted}

    def _guest_url(self, url: str) -> str | None:
        """The index URL as the guest uses it; http(s) hosts join the default allowlist."""
        parts = urllib.parse.urlsplit(url)
        scheme = parts.scheme.lower()
        if scheme == "file":
            path = Path(urllib.parse.unquote(parts.path))
            if not path.is_dir():
                log.warning("network.pip_index_missing", url=url)
                return None
            root, sub = (path.parent, f"{path.name}/") if path.name == "simple" else (path, "")
            self.file_roots.append(root)
            return f"http://{INDEX_HOST}/{len(self.file_roots) - 1}/{sub}"
        if scheme in ("http", "https") and parts.hostname:
            try:
                port = parts.port or (443 if scheme == "https" else 80)
                self.defaults.append(parse_entry(f"{parts.hostname}:{port}"
                                                 if ":" not in parts.hostname
                                                 else f"[{parts.hostname}]:{port}", operator=True))
            except ValueError:
                log.warning("network.pip_index_unusable", url=url)
                return None
            return url
        log.warning("network.pip_index_unsupported", url=url)
        return None

    def policy(self, spec: NetworkSpec) -> Policy:
        extra = [parse_entry(text) for text in spec.allow]
        return Policy(self, spec.mode, [*self.defaults, *self.operator, *extra])

    def guest_config(self, spec: NetworkSpec) -> dict[str, Any]:
        """Fields of the ``net_config`` request that tells the agent its mode."""
        if spec.mode == "none":
            return {"mode": "none", "env": {}, "pip": None}
        proxy = f"http://127.0.0.1:{PROXY_PORT}"
        no_proxy = "localhost,127.0.0.1,::1"
        env = {"HTTP_PROXY": proxy, "HTTPS_PROXY": proxy, "http_proxy": proxy,
               "https_proxy": proxy, "NO_PROXY": no_proxy, "no_proxy": no_proxy}
        return {"mode": spec.mode, "env": env, "pip": dict(self.guest_pip)}

    def protected(self, addr: IPAddress, port: int) -> str | None:
        """Why ``addr`` is off limits to sandboxes (None: it is not)."""
        addr = _plain(addr)
        if addr in self.own:
            return "an address of the kernelhost host itself"
        if addr.is_loopback:
            return "a loopback address"
        if addr.is_link_local:
            return "a link-local address"
        if addr.is_unspecified or addr.is_multicast:
            return "not a unicast address"
        if addr.is_private or addr.is_reserved or not addr.is_global:
            return "a private or reserved address"
        return None

    def api_endpoint(self, addr: IPAddress, port: int) -> bool:
        """The service's own API: refused whatever anybody listed."""
        if port != self.settings.port:
            return False
        addr = _plain(addr)
        return addr.is_loopback or addr in self.own or addr.is_unspecified or \
            str(addr) == self.settings.host


class Policy:
    """One sandbox's rules: which (host, port) it may open, checked after name resolution."""

    def __init__(self, host: HostNetwork, mode: str, entries: list[AllowEntry]) -> None:
        self.host = host
        self.mode = mode
        self.entries = entries

    def serves_index(self, name: str, port: int) -> bool:
        return self.mode != "none" and name == INDEX_HOST and port == 80 \
            and bool(self.host.file_roots)

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The addresses ``host:port`` may be reached at; Refused says why not."""
        name = host.strip().lower().rstrip(".")
        where = f"{name}:{port}"
        if self.mode == "none":
            raise Refused("kernelhost: this sandbox has no network (network mode none); "
                          "create it with network mode allowlist or outbound")
        if not isinstance(port, int) or not 0 < port < 65536:
            raise Refused(f"kernelhost: port {port!r} is not valid", 400)
        literal: IPAddress | None
        try:
            literal = ipaddress.ip_address(name.strip("[]"))
            name = str(literal)
        except ValueError:
            literal = None
            if not _HOSTNAME.match(name) or name.startswith("*.") or len(name) > 253:
                raise Refused(f"kernelhost: {host[:100]!r} is not a host name", 400) from None
        matched = [e for e in self.entries if e.matches(name, port)]
        if self.mode == "allowlist" and not matched:
            raise Refused(f"kernelhost: {where} is not in this sandbox's network allowlist")
        # explicitly listed by the operator (not a wildcard): may be a private address
        trusted = any(e.operator and not e.wildcard for e in matched)
        if literal is not None:
            addrs = [literal]
        else:
            loop = asyncio.get_running_loop()
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(name, port, type=socket.SOCK_STREAM), CONNECT_TIMEOUT)
            except (OSError, asyncio.TimeoutError) as exc:
                raise Refused(f"kernelhost: cannot resolve {name}: "
                              f"{exc or 'timed out'}", 502) from None
            addrs = list(dict.fromkeys(
                ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos))
        allowed: list[IPAddress] = []
        reasons = []
        for addr in addrs:
            why = "the kernelhost API" if self.host.api_endpoint(addr, port) else \
                None if trusted else self.host.protected(addr, port)
            if why is None:
                allowed.append(addr)
            else:
                reasons.append(f"{addr} is {why}")
        if not allowed:
            hint = "" if any("kernelhost API" in r for r in reasons) else \
                " (an operator can list it in network_allow)"
            raise Refused(f"kernelhost: {where} refused: {'; '.join(reasons)[:200]}; sandboxes "
                          f"may not reach it{hint}")
        return allowed


# -- tunnels ---------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Tunnel:
    id: int
    credit: int = WINDOW  # bytes we may still send to the guest
    room: asyncio.Event = field(default_factory=asyncio.Event)
    inbox: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    inbox_bytes: int = 0  # bytes from the guest not yet written out (at most WINDOW)
    task: asyncio.Task[None] | None = None
    guest_closed: bool = False


class Tunnels:
    """The host side of one agent's tunnels; ``close()`` ends every one of them."""

    def __init__(self, policy: Policy, agent: AgentClient, sandbox_id: str) -> None:
        self.policy = policy
        self.agent = agent
        self.log = log.bind(sandbox_id=sandbox_id, network=policy.mode)
        self.tunnels: dict[int, _Tunnel] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.closed = False
        self.opened_total = 0
        self.refused_total = 0

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _send(self, kind: str, tunnel_id: int, **fields: Any) -> None:
        await self.agent.send_net({"op": "net", "t": kind, "tunnel": tunnel_id, **fields})

    def on_frame(self, frame: dict[str, Any]) -> None:
        """A ``net`` frame from the guest (runs on the channel's reader: never blocks)."""
        kind, tunnel_id = frame.get("t"), frame.get("tunnel")
        if self.closed or not isinstance(tunnel_id, int) or isinstance(tunnel_id, bool) \
                or not 0 < tunnel_id < 1 << 62:
            return
        tun = self.tunnels.get(tunnel_id)
        if kind == "open":
            host, port = frame.get("host"), frame.get("port")
            if tun is not None:
                return
            if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
                self._spawn(self._send("opened", tunnel_id, ok=False, status=400,
                                       error="kernelhost: open needs a host and a port"))
                return
            if len(self.tunnels) >= MAX_TUNNELS:
                self.refused_total += 1
                self.log.warning("network.refused", host=host[:100], port=port,
                                 reason="too many connections")
                self._spawn(self._send("opened", tunnel_id, ok=False, status=503, error=(
                    f"kernelhost: this sandbox already has {MAX_TUNNELS} connections open")))
                return
            tun = _Tunnel(tunnel_id)
            tun.room.set()
            self.tunnels[tunnel_id] = tun
            tun.task = self._spawn(self._run(tun, host[:300], port))
            return
        if tun is None:
            if kind != "close":  # a tunnel of an earlier host, or one we ended
                self._spawn(self._send("close", tunnel_id))
            return
        if kind == "data":
            data = frame.get("data")
            if not isinstance(data, bytes) or tun.inbox_bytes + len(data) > WINDOW:
                self.log.warning("network.flow_control_broken", tunnel=tunnel_id)
                self._end(tun)
                return
            tun.inbox_bytes += len(data)
            tun.inbox.put_nowait(data)
        elif kind == "ack":
            n = frame.get("n")
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                tun.credit = min(WINDOW, tun.credit + n)
                tun.room.set()
        elif kind == "close":
            tun.guest_closed = True
            tun.inbox.put_nowait(None)

    def _end(self, tun: _Tunnel) -> None:
        if tun.task is not None:
            tun.task.cancel()

    def close(self) -> None:
        """End every tunnel (the sandbox closes, hibernates, forks away or changes VM)."""
        self.closed = True
        for task in list(self.tasks):
            task.cancel()
        self.tunnels.clear()

    async def aclose(self) -> None:
        self.close()
        tasks = list(self.tasks)
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task

    async def _run(self, tun: _Tunnel, host: str, port: int) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            if self.policy.serves_index(host.lower(), port):
                await self._send("opened", tun.id, ok=True)
                self.opened_total += 1
                await _serve_index(self, tun, self.policy.host.file_roots)
                return
            try:
                addrs = await self.policy.resolve(host, port)
                reader, writer = await self._connect(host, addrs, port)
            except Refused as exc:
                self.refused_total += 1
                self.log.warning("network.refused", host=host[:100], port=port, reason=str(exc))
                await self._send("opened", tun.id, ok=False, status=exc.status, error=str(exc))
                return
            self.opened_total += 1
            await self._send("opened", tun.id, ok=True)
            up = asyncio.ensure_future(self._to_remote(tun, writer))
            down = asyncio.ensure_future(self._from_remote(tun, reader))
            try:
                await asyncio.wait([up, down], return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (up, down):
                    task.cancel()
                for task in (up, down):
                    with contextlib.suppress(BaseException):
                        await task
        except ChannelClosed:
            pass
        finally:
            self.tunnels.pop(tun.id, None)
            if writer is not None:
                writer.close()
            if not tun.guest_closed and not self.closed and self.agent.connected:
                with contextlib.suppress(ChannelClosed):
                    await asyncio.shield(self._send("close", tun.id))

    async def _connect(self, host: str, addrs: list[IPAddress], port: int
                       ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        errors = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CONNECT_TIMEOUT
        for addr in addrs:
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                return await asyncio.wait_for(
                    asyncio.open_connection(str(addr), port, limit=CHUNK), left)
            except (OSError, asyncio.TimeoutError) as exc:
                errors.append(f"{addr}: {exc or 'timed out'}")
        raise Refused(f"kernelhost: cannot connect to {host}:{port}: "
                      f"{'; '.join(errors)[:200] or 'timed out'}", 502)

    async def _to_remote(self, tun: _Tunnel, writer: asyncio.StreamWriter) -> None:
        while True:
            data = await tun.inbox.get()
            if data is None:
                return
            writer.write(data)
            await writer.drain()
            tun.inbox_bytes -= len(data)
            await self._send("ack", tun.id, n=len(data))

    async def _from_remote(self, tun: _Tunnel, reader: asyncio.StreamReader) -> None:
        while True:
            data = await reader.read(await self._credit(tun))
            if not data:
                return
            await self.send_data(tun, data)

    async def _credit(self, tun: _Tunnel) -> int:
        """Wait until the guest has room for more of this tunnel; how much (at most CHUNK)."""
        while tun.credit <= 0:
            tun.room.clear()
            await tun.room.wait()
        return min(CHUNK, tun.credit)

    async def send_data(self, tun: _Tunnel, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = await self._credit(tun)
            piece, view = bytes(view[:n]), view[n:]
            tun.credit -= len(piece)
            await self._send("data", tun.id, data=piece)


async def _serve_index(tunnels: Tunnels, tun: _Tunnel, roots: list[Path]) -> None:
    """Answer one HTTP GET for a file under one of the host's file:// index roots."""
    head = b""
    while b"\r\n\r\n" not in head:
        data = await tun.inbox.get()
        if data is None or len(head) > 16384:
            return
        head += data
        tun.inbox_bytes -= len(data)
        await tunnels._send("ack", tun.id, n=len(data))
    line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    status, body, path = 404, b"not found\n", None
    if len(line) == 3 and line[0] in ("GET", "HEAD"):
        parts = urllib.parse.unquote(urllib.parse.urlsplit(line[1]).path).split("/", 2)
        if len(parts) == 3 and parts[1].isdigit() and int(parts[1]) < len(roots):
            root = roots[int(parts[1])].resolve()
            target = (root / parts[2]).resolve()
            if target.is_dir():
                target = target / "index.html"
            hidden = any(p.startswith(".") for p in target.relative_to(root).parts) \
                if target.is_relative_to(root) else True
            if not hidden and target.is_file():
                status, path = 200, target
    kind = "text/html" if path is not None and path.suffix == ".html" else \
        "application/octet-stream" if path is not None else "text/plain"
    size = path.stat().st_size if path is not None else len(body)
    await tunnels.send_data(tun, (
        f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\nContent-Type: {kind}\r\n"
        f"Content-Length: {size}\r\nConnection: close\r\n\r\n").encode())
    if line and line[0] == "HEAD":
        return
    if path is None:
        await tunnels.send_data(tun, body)
        return
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            await tunnels.send_data(tun, chunk)
