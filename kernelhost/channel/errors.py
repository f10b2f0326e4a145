"""Errors of the channel to a guest agent.

ChannelError
├── ChannelClosed           the channel is closed (VM gone, agent exited, closed by us)
├── ChannelTimeout          a deadline passed (also a TimeoutError)
├── AgentError              the agent answered ``ok: false``
├── NotSupportedByAgent     the agent did not announce the capability an op needs
└── ProtocolViolation       the guest broke the protocol (the channel is then closed)
"""

from __future__ import annotations


class ChannelError(Exception):
    """Base of the channel's errors."""


class ChannelClosed(ChannelError):
    """The channel is closed (VM gone, agent exited, or closed by us)."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A request, a send or a connect did not finish within its deadline."""


class AgentError(ChannelError):
    """The agent answered a request with ``ok: false``."""


class NotSupportedByAgent(ChannelError):
    """The agent's image predates an op: it did not announce the capability in ``hello``."""

    def __init__(self, op: str, capability: str) -> None:
        super().__init__(f"the guest agent has no {capability!r} capability (needed by {op!r})")
        self.op = op
        self.capability = capability


class ProtocolViolation(ChannelError):
    """The guest broke the protocol; the channel is closed and the VM must not be trusted."""
