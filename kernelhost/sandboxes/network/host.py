"""What every sandbox's network policy starts from, discovered once at service start: the host's
pip indexes (the default allowlist), the operator's ``network_allow`` entries, the host's own
addresses (never reachable from a sandbox) and the service's API endpoint.

Package indexes the host's pip uses that are local directories (``file://``) are offered to the
guest under the virtual origin ``http://INDEX_HOST/<n>/``; the API layer serves them, read only,
on a local socket (``index_endpoint``) that a tunnel to that origin connects to.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import socket
import struct
import time
import urllib.parse
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from ...channel.protocol import PROXY_PORT, NetRefusal
from ...config import ConfigError, Settings
from ...pipconfig import PipIndexes, read_pip_config
from .policy import (
    CONNECT_TIMEOUT,
    AllowEntry,
    IPAddress,
    NetworkSpec,
    Policy,
    Refused,
    parse_entry,
    plain_address,
)

log = structlog.get_logger("kernelhost.network")

INDEX_HOST = "pip-index.kernelhost.internal"  # virtual origin of the host's file:// indexes
#: threads for the guests' name lookups: a pool of their own, so that names that never answer
#: cannot stall the default pool, which every libvirt call uses
RESOLVER_THREADS = 16
OWN_TTL = 5.0  # seconds the host's list of its own addresses is trusted


def host_addresses() -> set[IPAddress]:
    """Every address of this host: all IPv4 addresses the kernel treats as local (the LOCAL
    routes of ``/proc/net/fib_trie``, secondary addresses included), every IPv6 address of
    ``/proc/net/if_inet6``, and what the host name resolves to."""
    found: set[IPAddress] = set()
    with contextlib.suppress(OSError), open("/proc/net/fib_trie") as f:
        last = ""
        for line in f:
            text = line.strip()
            if text.startswith(("|--", "+--")):
                last = text[3:].split()[0]
            elif text.endswith("host LOCAL") and last:
                with contextlib.suppress(ValueError):
                    found.add(ipaddress.IPv4Address(last))
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():  # primary addresses, where fib_trie is missing
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                found.add(ipaddress.IPv4Address(packed[20:24]))  # SIOCGIFADDR
    with contextlib.suppress(OSError, ValueError), open("/proc/net/if_inet6") as f:
        for line in f:
            found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    with contextlib.suppress(OSError):
        for info in socket.getaddrinfo(socket.gethostname(), None):
            with contextlib.suppress(ValueError):
                found.add(ipaddress.ip_address(str(info[4][0]).split("%")[0]))
    return found


def url_entry(url: str) -> AllowEntry:
    """The operator's allowlist entry for an ``http(s)`` URL's host and port (its scheme's
    default port when it names none); ValueError for anything else."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r:.200} is not an http(s) URL with a host")
    port = parts.port or (443 if scheme == "https" else 80)
    host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
    return parse_entry(f"{host}:{port}", operator=True)


class HostNetwork:
    """The host's side of every sandbox's network: defaults, protection, guest configuration."""

    def __init__(
        self,
        settings: Settings,
        environ: Mapping[str, str] | None = None,
        pip: PipIndexes | None = None,
        own_addresses: set[IPAddress] | None = None,
    ) -> None:
        self.settings = settings
        # the host's own addresses, read again when older than OWN_TTL seconds (an address
        # added after the start is protected too), unless the caller fixes them (tests)
        self._fixed_own = own_addresses is not None
        self._own = {plain_address(a) for a in (own_addresses or set())}
        self._own_read = 0.0
        self.resolver = ThreadPoolExecutor(RESOLVER_THREADS, thread_name_prefix="kh-dns")
        self.operator: list[AllowEntry] = []
        for text in settings.network_allow:
            try:
                self.operator.append(parse_entry(text, operator=True))
            except ValueError as exc:
                raise ConfigError(f"setting network_allow (KERNELHOST_NETWORK_ALLOW): {exc}") from None
        self.pip = read_pip_config(environ) if pip is None else pip
        self.defaults: list[AllowEntry] = []
        self.file_roots: list[Path] = []
        #: the local socket of the server of ``file_roots`` (set by the API layer when it runs)
        self.index_endpoint: Path | None = None
        configured = ([self.pip.index_url] if self.pip.index_url else []) + self.pip.extra_index_urls
        urls = [u for u in (self._guest_url(u) for u in configured) if u]
        trusted = sorted(
            {urllib.parse.urlsplit(u).hostname or "" for u in urls if u.startswith("http://")} - {""}
        )
        self.guest_pip: dict[str, Any] = {}
        if urls:
            self.guest_pip = {"index-url": urls[0], "extra-index-url": urls[1:], "trusted-host": trusted}

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
                self.defaults.append(url_entry(url))
            except ValueError:
                log.warning("network.pip_index_unusable", url=url)
                return None
            return url
        log.warning("network.pip_index_unsupported", url=url)
        return None

    @property
    def own(self) -> set[IPAddress]:
        if not self._fixed_own and time.monotonic() - self._own_read > OWN_TTL:
            self._own = {plain_address(a) for a in host_addresses()}
            self._own_read = time.monotonic()
        return self._own

    async def lookup(self, name: str, port: int) -> list[IPAddress]:
        """The addresses of ``name``, resolved in the resolver's own threads."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT):
                infos = await loop.run_in_executor(
                    self.resolver, lambda: socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
                )
        except (OSError, TimeoutError) as exc:
            raise Refused(
                f"kernelhost: cannot resolve {name}: {exc or 'timed out'}", NetRefusal.UNREACHABLE
            ) from None
        return list(dict.fromkeys(ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos))

    def close(self) -> None:
        """Let the resolver's threads go (a lookup that never answers is abandoned)."""
        self.resolver.shutdown(wait=False, cancel_futures=True)

    def local_endpoint(self, name: str, port: int) -> Path | None:
        if name == INDEX_HOST and port == 80 and self.file_roots:
            return self.index_endpoint
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
        env = {
            "HTTP_PROXY": proxy,
            "HTTPS_PROXY": proxy,
            "http_proxy": proxy,
            "https_proxy": proxy,
            "NO_PROXY": no_proxy,
            "no_proxy": no_proxy,
        }
        return {"mode": spec.mode, "env": env, "pip": dict(self.guest_pip)}

    def protected(self, addr: IPAddress) -> str | None:
        """Why ``addr`` is off limits to sandboxes (None: it is not)."""
        addr = plain_address(addr)
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
        addr = plain_address(addr)
        return addr.is_loopback or addr in self.own or addr.is_unspecified or str(addr) == self.settings.host
