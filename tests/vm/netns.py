"""A network namespace for tests that need a network of their own: the service runs inside it
(``Service.launcher``), reached from the tests over a veth pair; its DNS and its interfaces are
the test's to shape. ``ip netns exec`` bind-mounts ``/etc/netns/<name>/resolv.conf`` over the
namespace's ``/etc/resolv.conf``.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

# answers nothing: every lookup sent to it waits for the resolver's own timeout
BLACKHOLE_DNS = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 53))
while True:
    s.recvfrom(4096)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@dataclass
class NetNS:
    name: str
    host_ip: str  # the tests' end of the veth pair
    ns_ip: str  # the namespace's end: where its service listens
    ns_if: str  # the namespace's end of the veth pair
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def launcher(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def run(self, *argv: str) -> subprocess.Popen[bytes]:
        """Start a process inside the namespace, ended with it."""
        proc = subprocess.Popen([*self.launcher, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def add_address(self, address: str) -> None:
        """Give the namespace one more address of its own: a secondary one on its interface."""
        _ip("-n", self.name, "addr", "add", f"{address}/32", "dev", self.ns_if)


@contextlib.contextmanager
def netns(blackhole_dns: bool = False) -> Iterator[NetNS]:
    tag = secrets.token_hex(3)
    name, host_if, ns_if = f"kh-{tag}", f"khh{tag}", f"khn{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    ns = NetNS(name, f"10.231.{octet}.1", f"10.231.{octet}.2", ns_if)
    etc = Path("/etc/netns") / name
    try:
        _ip("netns", "add", name)
        _ip("-n", name, "link", "set", "lo", "up")
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", name)
        _ip("addr", "add", f"{ns.host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", name, "addr", "add", f"{ns.ns_ip}/30", "dev", ns_if)
        _ip("-n", name, "link", "set", ns_if, "up")
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.53\noptions timeout:30 attempts:1\n")
        if blackhole_dns:
            ns.run(sys.executable, "-c", BLACKHOLE_DNS, "127.0.0.53")
        yield ns
    finally:
        for proc in ns.procs:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("link", "del", host_if)
        with contextlib.suppress(subprocess.CalledProcessError):
            _ip("netns", "del", name)
        shutil.rmtree(etc, ignore_errors=True)
