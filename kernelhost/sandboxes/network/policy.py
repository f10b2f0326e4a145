"""Which connections a sandbox may open: its network mode, allowlist entries, and the rules that
protect the host (docs/network.md).

A connection is checked after name resolution: the host's own addresses, loopback, link-local
and private ranges are refused unless the operator listed that host explicitly, and the
service's own API port always is, so an escaped or hostile guest cannot reach the kernelhost
API or libvirt.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ...channel.protocol import NetRefusal
from ..errors import InvalidRequest

MODES = ("none", "allowlist", "outbound")
MAX_ALLOW = 64  # entries a create request may add
CONNECT_TIMEOUT = 10.0  # seconds for name resolution plus the TCP connect
_HOSTNAME = re.compile(r"^(\*\.)?[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$")
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


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
    shape = (
        "use 'host', 'host:port', '*.example.org[:port]' or an IP address ('[v6]:port' for IPv6 with a port)"
    )
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
            raise ValueError(f"allow entry {text!r} is not a host name or IP address; {shape}") from None
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
        return cls(str(data["mode"]), tuple(str(a) for a in allow) if isinstance(allow, list) else ())


def parse_network(value: Any) -> NetworkSpec:
    """The ``network`` field of a create request: a mode name, or ``{"mode", "allow"}``."""
    fix = (
        'give "none", "allowlist" or "outbound", or {"mode": "allowlist", "allow": '
        '["host:port", ...]}; see docs/network.md'
    )
    if value is None:
        return NetworkSpec()
    if isinstance(value, NetworkSpec):
        return value
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, dict):
        raise InvalidRequest(f"field 'network' is {value!r:.80}; {fix}", field="network")
    unknown = set(value) - {"mode", "allow"}
    if unknown:
        raise InvalidRequest(f"field 'network' has unknown keys {sorted(unknown)}; {fix}", field="network")
    mode = value.get("mode", "none")
    if mode not in MODES:
        raise InvalidRequest(
            f"network mode {mode!r} is not one of none, allowlist, outbound; {fix}", field="network.mode"
        )
    allow = value.get("allow") or []
    if not isinstance(allow, list) or len(allow) > MAX_ALLOW:
        raise InvalidRequest(
            f"network.allow must be a list of at most {MAX_ALLOW} entries ('host[:port]')",
            field="network.allow",
        )
    if allow and mode != "allowlist":
        raise InvalidRequest(
            f"network.allow applies to mode 'allowlist' only, not {mode!r}; drop it or set mode to allowlist",
            field="network.allow",
        )
    entries = []
    for item in allow:
        try:
            entries.append(str(parse_entry(item)))
        except ValueError as exc:
            raise InvalidRequest(f"network.allow: {exc}", field="network.allow") from None
    return NetworkSpec(mode, tuple(dict.fromkeys(entries)))


class Refused(Exception):
    """A connection the policy or the destination refused; the message is shown to the guest."""

    def __init__(self, message: str, reason: NetRefusal = NetRefusal.POLICY) -> None:
        super().__init__(message)
        self.reason = reason


def plain_address(addr: IPAddress) -> IPAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


class HostInfo(Protocol):
    """What a policy asks of the host (``host.HostNetwork``, which builds the policies)."""

    async def lookup(self, name: str, port: int) -> list[IPAddress]: ...

    def local_endpoint(self, name: str, port: int) -> Path | None: ...

    def protected(self, addr: IPAddress) -> str | None: ...

    def api_endpoint(self, addr: IPAddress, port: int) -> bool: ...


class Policy:
    """One sandbox's rules: which (host, port) it may open, checked after name resolution."""

    def __init__(self, host: HostInfo, mode: str, entries: list[AllowEntry]) -> None:
        self.host = host
        self.mode = mode
        self.entries = entries

    def local_endpoint(self, name: str, port: int) -> Path | None:
        """The host-local socket a virtual destination stands for (the package-index server
        behind ``INDEX_HOST``), or None for an ordinary destination."""
        if self.mode == "none":
            return None
        return self.host.local_endpoint(name.strip().lower().rstrip("."), port)

    async def resolve(self, host: str, port: int) -> list[IPAddress]:
        """The addresses ``host:port`` may be reached at; Refused says why not."""
        name = host.strip().lower().rstrip(".")
        if self.mode == "none":
            raise Refused(
                "kernelhost: this sandbox has no network (network mode none); "
                "create it with network mode allowlist or outbound"
            )
        if not isinstance(port, int) or not 0 < port < 65536:
            raise Refused(f"kernelhost: port {port!r} is not valid", NetRefusal.INVALID)
        literal: IPAddress | None
        try:
            literal = ipaddress.ip_address(name.strip("[]"))
            name = str(literal)
        except ValueError:
            literal = None
            if not _HOSTNAME.match(name) or name.startswith("*.") or len(name) > 253:
                raise Refused(f"kernelhost: {host[:100]!r} is not a host name", NetRefusal.INVALID) from None
        matched = [e for e in self.entries if e.matches(name, port)]
        if self.mode == "allowlist" and not matched:
            raise Refused(f"kernelhost: {name}:{port} is not in this sandbox's network allowlist")
        # explicitly listed by the operator (not a wildcard): may be a private address
        trusted = any(e.operator and not e.wildcard for e in matched)
        addrs = [literal] if literal is not None else await self.host.lookup(name, port)
        return self._check(f"{name}:{port}", addrs, port, trusted)

    def _check(self, where: str, addrs: list[IPAddress], port: int, trusted: bool) -> list[IPAddress]:
        allowed: list[IPAddress] = []
        reasons = []
        for addr in addrs:
            why = (
                "the kernelhost API"
                if self.host.api_endpoint(addr, port)
                else None
                if trusted
                else self.host.protected(addr)
            )
            if why is None:
                allowed.append(addr)
            else:
                reasons.append(f"{addr} is {why}")
        if not allowed:
            hint = (
                ""
                if any("kernelhost API" in r for r in reasons)
                else " (an operator can list it in network_allow)"
            )
            raise Refused(
                f"kernelhost: {where} refused: {'; '.join(reasons)[:200]}; sandboxes may not reach it{hint}"
            )
        return allowed
