"""Connections to servers in a sandbox (docs/ports.md): the API layer routes a request for
``{port}-{sandbox id}.{domain}`` here and speaks HTTP or WebSocket over the socket it gets."""

from __future__ import annotations

import socket

from ...channel import ChannelError, NotSupportedByAgent
from ..context import Context
from ..errors import (
    AgentUnresponsive,
    InvalidRequest,
    NotSupportedByImage,
    PortNotOpen,
    Remedy,
    SandboxNotRunning,
)
from ..network import PortClosed
from ..sandbox import Sandbox, ensure_usable
from .files import WaitForVm


class Ports:
    """The host's connections to the sandboxes' ports."""

    def __init__(self, ctx: Context, wait_for_vm: WaitForVm) -> None:
        self._ctx = ctx
        self._wait_for_vm = wait_for_vm

    async def connect(self, sbx: Sandbox, port: int) -> socket.socket:
        """A local socket connected to 127.0.0.1:``port`` in ``sbx`` (woken if hibernated);
        the connection counts as the sandbox being used."""
        if not 0 < port < 65536:
            raise InvalidRequest(f"port {port} is not a TCP port (1-65535)", field="port")
        await self._wait_for_vm(sbx)
        ensure_usable(sbx)
        ingress = sbx.ingress
        if ingress is None or sbx.live_agent is None:
            raise SandboxNotRunning(
                f"sandbox {sbx.id} is {sbx.record.state}",
                remedy=Remedy.RESTART,
                state=sbx.record.state.value,
                sandbox_id=sbx.id,
            )
        self._ctx.registry.touch(sbx)
        try:
            return await ingress.connect(port)
        except PortClosed as exc:
            raise PortNotOpen(
                f"sandbox {sbx.id} is running, but {exc}; start a server listening on port {port} "
                "(on 0.0.0.0 or 127.0.0.1) in it",
                sandbox_id=sbx.id,
                port=port,
            ) from None
        except NotSupportedByAgent:
            raise NotSupportedByImage(
                f"the guest image of template {sbx.record.template!r} cannot take connections to "
                "its ports; rebuild the images (make image) and create the sandbox again",
                sandbox_id=sbx.id,
            ) from None
        except (ChannelError, TimeoutError) as exc:
            raise AgentUnresponsive(
                f"sandbox {sbx.id}: its agent did not open port {port}: {exc or type(exc).__name__}",
                sandbox_id=sbx.id,
            ) from None

    def touch(self, sbx: Sandbox) -> None:
        """A connection still in use (an open WebSocket) counts as the sandbox being used."""
        self._ctx.registry.touch(sbx)
