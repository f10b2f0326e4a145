"""Per-sandbox network modes through real VMs (docs/network.md): none, allowlist, outbound.

One service of its own (its operator allowlist names a small HTTP server this module starts on a
non-loopback address of this host) and one sandbox per mode, shared by the checks of that mode.
The package index is whatever the host's pip is configured to use, discovered at run time.
"""

from __future__ import annotations

import http.server
import ipaddress
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from kernelhost import AsyncSandbox
from kernelhost.config import Settings
from kernelhost.sandboxes.network import HostNetwork, host_addresses

from ..harness import Service, running_service

pytestmark = pytest.mark.vm

PACKAGE = "six"  # small, pure Python; must be in the host's configured index
# the image may hold a distribution copy: make pip fetch it from the index all the same
PIP = f"python3 -m pip install --no-cache-dir --ignore-installed --no-deps {PACKAGE} 2>&1"


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the host test server"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def local_server() -> Iterator[tuple[str, int]]:
    addrs = sorted(
        str(a) for a in host_addresses() if isinstance(a, ipaddress.IPv4Address) and not a.is_loopback
    )
    assert addrs, "this host has no non-loopback IPv4 address to serve the test server on"
    server = http.server.ThreadingHTTPServer((addrs[0], 0), _Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield addrs[0], int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def net_service(tmp_path_factory: pytest.TempPathFactory, local_server: tuple[str, int]) -> Iterator[Service]:
    addr, port = local_server
    with running_service(
        tmp_path_factory.mktemp("net-state"), "vm-network", KERNELHOST_NETWORK_ALLOW=f"{addr}:{port}"
    ) as svc:
        yield svc


def _has_index() -> bool:
    return bool(HostNetwork(Settings(state_dir=Path("/tmp")), own_addresses=set()).guest_pip)


async def _make(svc: Service, network: object) -> AsyncSandbox:
    return await AsyncSandbox.create(
        template="python",
        network=network,  # type: ignore[arg-type]
        url=svc.url,
        api_key=svc.api_key,
    )


@pytest.fixture(scope="module")
async def outbound(net_service: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await _make(net_service, "outbound")
    try:
        yield sbx
    finally:
        await sbx.close()


FETCH = """
import urllib.request, urllib.error
def fetch(url, proxy=True):
    handlers = [] if proxy else [urllib.request.ProxyHandler({})]
    try:
        with urllib.request.build_opener(*handlers).open(url, timeout=60) as r:
            return f"OK {r.status} {' '.join(r.read(200).decode(errors='replace').split())}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code} {exc.reason}"
    except Exception as exc:
        return f"FAIL {type(exc).__name__}: {exc}"
import socket
def connect(target):
    # ask the sandbox's proxy directly (urllib skips it for NO_PROXY hosts such as 127.0.0.1)
    with socket.create_connection(("127.0.0.1", 3128), timeout=60) as s:
        s.sendall(f"CONNECT {target} HTTP/1.1\\r\\nHost: {target}\\r\\n\\r\\n".encode())
        return s.makefile("rb").readline().decode(errors="replace").strip()
"""


async def _py(sbx: AsyncSandbox, code: str, timeout: float = 300) -> str:
    execution = await sbx.run_code(code, timeout=timeout)
    assert execution.error is None, execution.error
    return execution.stdout


async def test_none_has_no_network(net_service: Service, local_server: tuple[str, int]) -> None:
    addr, port = local_server
    sbx = await _make(net_service, None)
    try:
        assert (await sbx.info()).network == {"mode": "none", "allow": []}
        t0 = time.monotonic()
        pip = await sbx.run_code(PIP, language="bash", timeout=300)
        took = time.monotonic() - t0
        assert pip.exit_code != 0, pip.stdout
        assert "Failed to establish a new connection" in pip.stdout or "name resolution" in pip.stdout, (
            pip.stdout
        )
        assert took < 120, f"pip took {took:.0f}s to fail"
        out = await _py(
            sbx,
            (
                "import socket\n"
                f"for where in [({addr!r}, {port}), ('127.0.0.1', 3128), ('10.0.2.2', 80)]:\n"
                "    try:\n"
                "        socket.create_connection(where, timeout=5).close(); print(where, 'OPEN')\n"
                "    except OSError as exc:\n"
                "        print(where, 'refused', exc.errno)\n"
                "import os; print(sorted(k for k in os.environ if 'proxy' in k.lower()))"
            ),
        )
        assert "OPEN" not in out, out
        assert out.strip().endswith("[]"), out
    finally:
        await sbx.close()


async def test_allowlist_installs_from_the_index_and_refuses_the_rest(
    net_service: Service, local_server: tuple[str, int]
) -> None:
    assert _has_index(), (
        "the host's pip configuration names no package index the guest can "
        "use: configure pip (PIP_INDEX_URL or pip.conf) on this machine"
    )
    addr, port = local_server
    sbx = await _make(net_service, {"mode": "allowlist", "allow": ["10.0.2.2:80"]})
    try:
        assert (await sbx.info()).network == {"mode": "allowlist", "allow": ["10.0.2.2:80"]}
        pip = await sbx.run_code(PIP, language="bash", timeout=600)
        assert pip.exit_code == 0 and "Successfully installed" in pip.stdout, pip.stdout
        # the running kernel imports the copy pip just put in /usr/local
        imported = await sbx.run_code(
            f"import importlib, {PACKAGE}; importlib.reload({PACKAGE}); {PACKAGE}.__file__"
        )
        assert imported.error is None, imported.error
        assert imported.text is not None, imported
        assert imported.text.startswith("'/usr/local/lib/"), imported.text
        out = await _py(
            sbx,
            FETCH
            + (
                "print(fetch('https://example.com/'))\n"
                "print(fetch('http://example.com/'))\n"
                f"print(fetch('http://{addr}:{port}/'))\n"
                "print(connect('10.0.2.2:80'))\n"
            ),
        )
        lines = out.splitlines()
        assert "not in this sandbox's network allowlist" in lines[0], out
        assert "403" in lines[1] and "allowlist" in lines[1], out
        # the operator's network_allow entries apply to every allowlist sandbox
        assert lines[2] == "OK 200 hello from the host test server", out
        # a tenant's own entry never lifts the protection of private addresses
        assert lines[3].startswith("HTTP/1.1 403") and "private" in lines[3], out
    finally:
        await sbx.close()


async def test_outbound_reaches_what_is_not_protected(
    outbound: AsyncSandbox, net_service: Service, local_server: tuple[str, int]
) -> None:
    addr, port = local_server
    api_port = int(net_service.url.rsplit(":", 1)[1])
    assert (await outbound.info()).network == {"mode": "outbound", "allow": []}
    out = await _py(
        outbound,
        FETCH
        + (
            "import configparser\n"
            "conf = configparser.ConfigParser(); conf.read('/etc/pip.conf')\n"
            "index = conf.get('global', 'index-url', fallback='')\n"
            f"print(fetch(index + '{PACKAGE}/') if index else 'OK no index')\n"
            f"print(fetch('http://{addr}:{port}/'))\n"
            f"for target in ['127.0.0.1:{api_port}', 'localhost:{api_port}',\n"
            "               'no-such-host.invalid:443', '169.254.169.254:80']:\n"
            "    print(connect(target))\n"
        ),
    )
    lines = out.splitlines()
    assert lines[0].startswith("OK 200"), out  # the package index, listed nowhere
    assert lines[1] == "OK 200 hello from the host test server", out  # operator-listed
    # the kernelhost API is refused even in outbound mode
    assert lines[2].startswith("HTTP/1.1 403") and "kernelhost API" in lines[2], out
    assert lines[3].startswith("HTTP/1.1 403") and "kernelhost API" in lines[3], out
    # a name listed nowhere passes the policy: it fails at name resolution on the host
    assert lines[4].startswith("HTTP/1.1 502") and "cannot resolve" in lines[4], out
    assert lines[5].startswith("HTTP/1.1 403") and "link-local" in lines[5], out


async def test_forks_inherit_the_network(outbound: AsyncSandbox, local_server: tuple[str, int]) -> None:
    addr, port = local_server
    [kid] = await outbound.fork(1)
    try:
        assert (await kid.info()).network == {"mode": "outbound", "allow": []}
        out = await _py(kid, FETCH + f"print(fetch('http://{addr}:{port}/'))")
        assert out.strip() == "OK 200 hello from the host test server", out
    finally:
        await kid.close()


async def test_network_survives_hibernation_and_a_service_restart(
    net_service: Service, local_server: tuple[str, int]
) -> None:
    """The tunnel's host side is re-established when the sandbox wakes and when a restarted
    service reattaches it; the kernel keeps its proxy environment."""
    addr, port = local_server
    sbx = await _make(net_service, "outbound")
    fetch = FETCH + f"print(fetch('http://{addr}:{port}/'))"
    try:
        assert (await _py(sbx, fetch)).strip() == "OK 200 hello from the host test server"
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {net_service.api_key}"}) as http:
            r = await http.post(f"{net_service.url}/v1/sandboxes/{sbx.id}/hibernate")
            assert r.status == 200 and (await r.json())["state"] == "hibernated"
        woken = await _py(sbx, fetch)  # wakes it
        assert woken.strip() == "OK 200 hello from the host test server", woken
        net_service.stop()
        net_service.start()
        again = await _py(sbx, fetch)
        assert again.strip() == "OK 200 hello from the host test server", again
        assert (await sbx.info()).network == {"mode": "outbound", "allow": []}
    finally:
        await sbx.close()
