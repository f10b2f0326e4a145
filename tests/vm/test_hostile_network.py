"""What a sandbox with a network can do to the host's network side, through a real service that
runs in a network namespace of the test's own (``netns.py``): DNS that never answers, and an
address the host gains after it started.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from kernelhost import AsyncSandbox

from ..harness import Service, running_service
from .netns import NetNS, netns

pytestmark = pytest.mark.vm

PUBLIC = "45.33.32.1"  # a global address the namespace takes on after the service started

# 32 connections through the guest's proxy to names the host's DNS never answers
STALL_DNS = r"""
import socket, threading
def stall(i):
    try:
        s = socket.create_connection(('127.0.0.1', 3128), timeout=120)
        s.sendall(f'CONNECT never-{i}.example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n'.encode())
        s.recv(100)
    except OSError:
        pass
for i in range(32):
    threading.Thread(target=stall, args=(i,), daemon=True).start()
"""


@pytest.fixture(scope="module")
def ns() -> Iterator[NetNS]:
    with netns(blackhole_dns=True) as space:
        space.run(sys.executable, "-m", "http.server", "--bind", "0.0.0.0", "8088")
        yield space


@pytest.fixture(scope="module")
def ns_service(ns: NetNS, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("ns-state"),
        "vm-netns",
        launcher=ns.launcher,
        KERNELHOST_HOST=ns.ns_ip,
        KERNELHOST_POOL_SIZE="1",
    ) as svc:
        yield svc


@pytest.fixture
async def outbound(ns_service: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(url=ns_service.url, api_key=ns_service.api_key, network="outbound")
    try:
        yield sbx
    finally:
        await sbx.close()


async def test_names_that_never_resolve_stall_no_other_tenant(
    ns_service: Service, outbound: AsyncSandbox
) -> None:
    started = await outbound.run_code(STALL_DNS, timeout=60)
    assert started.status == "ok", started.error
    await asyncio.sleep(2)  # 32 lookups are waiting on a DNS server that never answers
    t0 = time.monotonic()
    other = await AsyncSandbox.create(url=ns_service.url, api_key=ns_service.other_key)
    try:
        assert (await other.run_code("1 + 1", timeout=60)).text == "2"
        [child] = await other.fork(1)
        await child.close()
    finally:
        await other.close()
    took = time.monotonic() - t0
    # the lookups hold their threads for 30 s (the DNS never answers); libvirt calls must not
    # queue behind them
    assert took < 20, f"another key's create, fork and delete took {took:.0f} s behind the lookups"


async def test_an_address_the_host_gains_later_is_protected_too(ns: NetNS, outbound: AsyncSandbox) -> None:
    ns.add_address(PUBLIC)  # after the service started: it must notice
    await asyncio.sleep(6)  # the service re-reads its addresses every few seconds
    probe = await outbound.run_code(
        "import urllib.request\n"
        "try:\n"
        f"    urllib.request.urlopen('http://{PUBLIC}:8088/', timeout=30)\n"
        "    print('reached')\n"
        "except Exception as exc:\n"
        "    print('refused', exc)",
        timeout=90,
    )
    assert probe.stdout.startswith("refused"), probe.stdout
    assert "kernelhost host itself" in probe.stdout, probe.stdout
