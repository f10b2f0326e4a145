"""The agent: the port, the kernel, the relay and every area, wired together.

``Agent(config).start()`` opens the port, starts the kernel and answers the host until
``stop()``. The ops every agent has (``hello``, ``ping``, ``interrupt``, ``restart``) are here;
the optional ones are registered by their areas (bash, files, network, snapshots), and ``hello``
announces exactly those.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

from .bash import Bash
from .cgroups import Cgroups
from .config import AgentConfig
from .contexts import Contexts, hello_kernels
from .dispatch import Dispatcher, Handler
from .files import Files
from .kernel import Kernel
from .limits import ExecutionMeter
from .netproxy import NetProxy
from .network import Network
from .port import Port, find_port
from .relay import Relay
from .shared import codec, log, protocol
from .snapshot import Snapshots, WarmUp
from .tasks import TaskSet
from .users import Users

__all__ = ["Agent", "KernelOps", "run"]


class KernelOps:
    """The ops every agent has: the handshake, health, interrupt and restart."""

    capability = None

    def __init__(self, kernel: Kernel, dispatcher: Dispatcher, boot_id: str) -> None:
        self.kernel = kernel
        self.config = kernel.config
        self.dispatcher = dispatcher
        self.boot_id = boot_id
        #: the kernelspecs, read at the first hello (a template's VM, so its clones answer
        #: without reading them again: they are the image's, fixed)
        self._kernels: list[dict[str, str]] | None = None

    def ops(self) -> Mapping[str, Handler]:
        """hello, ping, interrupt and restart."""
        return {
            protocol.Op.HELLO: self.op_hello,
            protocol.Op.PING: self.op_ping,
            protocol.Op.INTERRUPT: self.op_interrupt,
            protocol.Op.RESTART: self.op_restart,
        }

    async def op_hello(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Answered once the kernel is ready (at once in a build VM, which has none): who this
        agent is, what it can do, and the kernelspecs a code context may start."""
        if self.config.start_kernel:
            await self.kernel.until_ready()
        if self._kernels is None:
            self._kernels = await asyncio.to_thread(hello_kernels, self.config)
        kernels = self._kernels
        return {
            "agent_version": protocol.AGENT_PROTOCOL,
            "capabilities": self.dispatcher.capabilities(),
            "kernel_info": self.kernel.kernel_info,
            "boot_id": self.boot_id,
            "kernels": kernels,  # [{name, language}], the main kernel's first
        }

    async def op_ping(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Health: whether the kernel is ready and its process alive (never waits for it)."""
        return {"ready": self.kernel.ready.is_set(), "kernel_alive": await self.kernel.is_alive()}

    async def op_interrupt(self, frame: dict[str, Any]) -> dict[str, Any]:
        """SIGINT to the kernel (its interrupt_mode is signal): stops the running cell."""
        await self.kernel.interrupt()
        return {}

    async def op_restart(self, frame: dict[str, Any]) -> dict[str, Any]:
        """A fresh kernel process (same VM, same files); answered once it is ready."""
        await self.kernel.restart(reason="requested")
        return {"kernel_info": self.kernel.kernel_info}


class Agent:
    """One guest agent: started once, answering the host until stopped."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.boot_id = uuid.uuid4().hex  # a new one per agent process: the host sees a reboot
        self.tasks = TaskSet()
        self.port: Port | None = None
        self.kernel = Kernel(config, self.send)
        meter = ExecutionMeter(self.kernel.pid)
        self.relay = Relay(self.kernel, meter, self.send, self.tasks, self.send_frames)
        self.contexts = Contexts(config, self.relay, self.send, self.tasks, self.send_frames)
        self.proxy = NetProxy(self.send, config.proxy_port)
        cgroups = Cgroups(config.cgroup_root)
        self.bash = Bash(config, self.send, self.tasks, cgroups, self.write_spliced)
        self.network = Network(config, self.kernel, self.bash, self.proxy, self.contexts.kernels)
        self.dispatcher = Dispatcher(self.send, self.tasks)
        self.dispatcher.register(KernelOps(self.kernel, self.dispatcher, self.boot_id))
        self.dispatcher.register(self.bash)
        self.dispatcher.register(self.bash.processes())
        raw_output = self.bash.raw_output()
        if raw_output is not None:
            self.dispatcher.register(raw_output)
        self.dispatcher.register(Files(config))
        self.dispatcher.register(self.network)
        self.dispatcher.register(Snapshots(config, self.kernel, self.contexts.kernels))
        self.dispatcher.register(WarmUp(self.kernel, config.language))
        self.dispatcher.register(self.proxy)  # announces INGRESS; its frames are kinds below
        self.dispatcher.register(self.contexts)
        self.dispatcher.register(Users(config, self.kernel, self.bash))
        # jupyter frames: the main kernel's to its relay, a context's to that context's
        self.dispatcher.register_kinds(self.contexts.frame_handlers())
        self.dispatcher.register_kinds(self.proxy.frame_handlers())

    def send(self, message: dict[str, Any]) -> bool:
        """Queue one frame for the host; False if it cannot be sent (logged)."""
        if self.port is None:
            log(f"no port open yet; dropping a {message.get('op')!r} frame")
            return False
        return self.port.send(message)

    def send_frames(self, frames: list[tuple[bytes, memoryview]]) -> bool:
        """Queue frames already encoded (``Port.send_frames``); False if no port is open."""
        if self.port is None:
            log("no port open yet; dropping stream frames")
            return False
        return self.port.send_frames(frames)

    def write_spliced(self, head: codec.FrameHead, fd: int, size: int) -> bool:
        """Write a frame of ``head`` whose last entry is the next ``size`` bytes of the pipe
        ``fd`` (``Port.write_spliced``; a relay thread calls it); False if no port is open."""
        port = self.port
        if port is None:
            log("no port open yet; dropping a spliced frame")
            return False
        return port.write_spliced(head, fd, size)

    async def start(self) -> None:
        """Open the port, start the kernel, and return once it answers (a build VM's agent
        starts no kernel)."""
        os.makedirs(self.config.kernel_cwd, exist_ok=True)
        if self.config.connection_file is not None:  # passable by a kernel launched as a user
            runtime = os.path.dirname(self.config.connection_file)
            os.makedirs(runtime, exist_ok=True)
            os.chmod(runtime, 0o755)
        self.network.start()
        self.port = await self._open_port()
        self.port.start()
        if not self.config.start_kernel:
            log("build VM: no kernel")
            return
        t0 = time.monotonic()
        await self.kernel.launch()
        self.relay.start()
        await self.kernel.wait_ready()
        log(f"kernel ready in {time.monotonic() - t0:.2f}s")
        self.tasks.spawn(self.kernel.monitor(), name="kernel-monitor")
        self.kernel.spawn_standby()
        self.bash.prepare_standby()

    async def _open_port(self) -> Port:
        loop = asyncio.get_running_loop()
        on_frame = self.dispatcher.on_frame
        if self.config.port_fd is not None:
            return Port(
                self.config.port_fd,
                loop,
                on_frame,
                max_frame_bytes=self.config.max_frame_bytes,
                owns_fd=False,
            )
        path = await asyncio.to_thread(find_port, self.config.port_name, self.config.port_timeout)
        return Port.open(path, loop, on_frame, self.config.max_frame_bytes)

    async def stop(self) -> None:
        """Kill bash commands, close the proxy, cancel every task, stop the code contexts, the
        kernel and the port."""
        await self.bash.stop()
        await self.proxy.close()
        await self.tasks.cancel_all()
        await self.contexts.stop()
        await self.kernel.stop()
        if self.port is not None:
            await asyncio.to_thread(self.port.close)
            self.port = None


async def run(config: AgentConfig) -> None:
    """Start an agent and serve until the process is killed (tini stops the VM with it)."""
    agent = Agent(config)
    await agent.start()
    try:
        await asyncio.Event().wait()  # serve: the agent's whole life, so no deadline
    finally:
        await agent.stop()
