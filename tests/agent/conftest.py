"""Fixtures of the agent's unit tier: the real guest agent, in this process, on a socketpair.

The agent (``guest-image/agent/kernelhost_agent``) is imported as the guest imports it, wired by
an ``AgentConfig`` to one end of a ``socket.socketpair()`` instead of the virtio port, and starts
a real local ipykernel from a temporary kernelspec whose argv runs the guest's own
``launch_kernel.py``. Everything it would touch in a VM is redirected into a temporary
directory: the kernel's working directory, bash's state, pip.conf, pip's site directory; the
proxy listens on a free port; cgroups, the clock, the entropy pool and the page cache are left
alone. The test drives the other end with the real codec (``host.HostEnd``).

Fixture graph (one agent and kernel per test module, as starting a kernel takes a second)::

    running (module)  ->  host (the HostEnd of that agent)

At teardown each module's agent must have logged no task failure and raised nothing into the
event loop: a hostile frame may be refused or dropped, never break the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .host import WAIT, HostEnd

AGENT_DIR = Path(__file__).resolve().parents[2] / "guest-image" / "agent"
sys.path.insert(0, str(AGENT_DIR))  # the package, importable as the guest imports it

from kernelhost_agent.agent import Agent  # noqa: E402
from kernelhost_agent.config import AgentConfig  # noqa: E402

KERNEL_NAME = "kernelhost-test"
START_TIMEOUT = 60.0  # a cold ipykernel here takes 1-2 s; a loaded CI machine may take more


@dataclass
class Running:
    """One started agent, the host end driving it, and the directory it was given."""

    agent: Agent
    host: HostEnd
    config: AgentConfig
    root: Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the proxy's; 3128 may be taken here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def write_kernelspec(root: Path) -> Path:
    """The guest's kernelspec, with this interpreter instead of /usr/bin/python3."""
    spec_dir = root / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    argv = [
        sys.executable,
        str(AGENT_DIR / "launch_kernel.py"),
        "-f",
        "{connection_file}",
        "--HistoryManager.hist_file=:memory:",
    ]
    spec = {
        "argv": argv,
        "display_name": "kernelhost (test)",
        "language": "python",
        "interrupt_mode": "signal",
        "metadata": {"debugger": True},
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    return root / "kernels"


def test_config(root: Path, port_fd: int, **overrides: Any) -> AgentConfig:
    """An AgentConfig that keeps the agent inside ``root`` and off the machine's settings."""
    environ = dict(os.environ)
    environ["IPYTHONDIR"] = str(root / "ipython")  # no profile written into the real home
    for key in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
        environ.pop(key, None)
    fields: dict[str, Any] = {
        "port_fd": port_fd,
        "kernel_name": KERNEL_NAME,
        "kernelspec_dirs": (str(write_kernelspec(root)),),
        "connection_file": str(root / "kernel-connection.json"),
        "kernel_cwd": str(root / "home"),
        "ready_timeout": START_TIMEOUT,
        "request_ready_timeout": START_TIMEOUT,
        "environ": environ,
        "bash_dir": str(root / "bash"),
        "cgroup_root": None,
        "pip_conf": str(root / "pip.conf"),
        "pip_site": str(root / "site-packages"),
        "proxy_port": free_port(),
        "set_clock": False,
        "add_entropy": False,
        "drop_caches": False,
        "unsigned_kernel": True,
    }
    fields.update(overrides)
    return AgentConfig(**fields)


@contextlib.asynccontextmanager
async def running_agent(root: Path, **overrides: Any) -> AsyncIterator[Running]:
    """Start an agent on a socketpair (``overrides``: fields of its config); stop it and check
    it stayed healthy."""
    loop = asyncio.get_running_loop()
    loop_errors: list[dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: loop_errors.append(context))
    host_sock, agent_sock = socket.socketpair()
    config = test_config(root, agent_sock.fileno(), **overrides)
    agent = Agent(config)
    host = HostEnd(host_sock)
    try:
        await host.open()
        await asyncio.wait_for(agent.start(), START_TIMEOUT)
        yield Running(agent, host, config, root)
    finally:
        await host.close()
        await asyncio.wait_for(agent.stop(), 3 * WAIT)
        agent_sock.close()
        loop.set_exception_handler(previous)
    assert agent.tasks.failures == 0, "an agent task failed; its traceback is in the log above"
    assert not loop_errors, loop_errors


@pytest.fixture(scope="session", autouse=True)
def default_interrupts() -> None:
    """In the guest, init starts the agent with SIGINT at its default; a test run started in the
    background of a shell inherits it ignored, and so would every command the agent runs (a
    SIGINT sent to one would do nothing). A Python handler is reset to the default at exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
async def running(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Running]:
    async with running_agent(tmp_path_factory.mktemp("agent")) as agent:
        yield agent


@pytest.fixture
def host(running: Running) -> HostEnd:
    return running.host
