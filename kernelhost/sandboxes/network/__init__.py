"""Per-sandbox network (docs/network.md): a guest never has a network interface; in modes
``allowlist`` and ``outbound`` its connections are tunnels over the agent channel that the host
checks and opens.

- ``policy``: modes, allowlist entries, the checks made after name resolution;
- ``host``: what the host contributes (pip indexes, its own addresses, the API endpoint);
- ``tunnels``: the host side of one agent's tunnels;
- ``ingress``: the host's connections to ports in the guest (docs/ports.md);
- ``pump``: bytes both ways through one tunnel, what ``tunnels`` and ``ingress`` share;
- ``indexes``: what a template's build VM may reach (the host's apt and pip indexes);
- ``SandboxNetwork`` (here): serve a sandbox's tunnels on its agent and tell the guest its mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from ...channel import AgentClient, ChannelError, NotSupportedByAgent
from ...channel.protocol import Op
from ...config import Settings
from ...metrics import Metrics
from ..errors import AgentUnresponsive, NotSupportedByImage
from .host import INDEX_HOST, HostNetwork, host_addresses
from .ingress import Ingress, PortClosed
from .policy import (
    MODES,
    AllowEntry,
    NetworkSpec,
    Policy,
    Refused,
    parse_entry,
    parse_network,
)
from .tunnels import MAX_TUNNELS, Tunnels

if TYPE_CHECKING:
    from ..sandbox import Sandbox

__all__ = [
    "INDEX_HOST",
    "MAX_TUNNELS",
    "MODES",
    "AllowEntry",
    "HostNetwork",
    "Ingress",
    "NetworkSpec",
    "Policy",
    "PortClosed",
    "Refused",
    "SandboxNetwork",
    "Tunnels",
    "host_addresses",
    "parse_entry",
    "parse_network",
]

log = structlog.get_logger("kernelhost.network")


class SandboxNetwork:
    """Gives each sandbox's agent its network: tunnels on the host side, the mode in the guest."""

    def __init__(self, settings: Settings, host: HostNetwork, metrics: Metrics) -> None:
        self.settings = settings
        self.host = host
        self.metrics = metrics

    def bind(self, sbx: Sandbox, agent: AgentClient) -> None:
        """Serve the guest's tunnels, and the host's into its ports, on this agent's channel;
        they end with the channel (close, hibernation, fork hand-over, VM replacement) or when
        another agent takes over."""
        if sbx.net is not None:
            sbx.net.close()
        if sbx.ingress is not None:
            sbx.ingress.close()
        spec = NetworkSpec.from_dict(sbx.record.network)
        sbx.net = Tunnels(self.host.policy(spec), agent, sbx.id, count=self.metrics.count_connection)
        agent.add_listener(sbx.net)
        sbx.ingress = Ingress(agent, sbx.id)  # the host's connections to the guest's ports
        agent.add_listener(sbx.ingress)

    async def configure(self, sbx: Sandbox, strict: bool) -> None:
        """Tell the guest its network mode (proxy, pip.conf, the kernel's proxy environment).

        A guest in mode "none" is as its template made it and is not told anything. ``strict``
        (create, replacement): a failure raises; otherwise (wake, fork, reattach) it is logged.
        """
        spec = NetworkSpec.from_dict(sbx.record.network)
        agent = sbx.agent
        if spec.mode == "none" or agent is None:
            return
        try:
            await agent.request(
                Op.NET_CONFIG, timeout=self.settings.timeouts.net_config, **self.host.guest_config(spec)
            )
        except ChannelError as exc:
            log.warning("sandbox.net_config_failed", sandbox_id=sbx.id, error=str(exc))
            if not strict:
                return
            if isinstance(exc, NotSupportedByAgent):
                raise NotSupportedByImage(
                    f"the guest image of template {sbx.record.template!r} has no network "
                    "support; rebuild the images (make image) and create the sandbox again"
                ) from exc
            raise AgentUnresponsive(
                f"sandbox {sbx.id}: its agent did not set up network mode {spec.mode!r}: "
                f"{exc or type(exc).__name__}",
                sandbox_id=sbx.id,
            ) from exc
