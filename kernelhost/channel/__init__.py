"""The wire protocol between the host service and the guest agent.

``codec`` is the sans-IO frame codec shared with the guest; ``client`` is the host's asyncio
client of one VM's agent.
"""

from .client import (
    AgentClient,
    AgentError,
    ChannelClosed,
    ChannelError,
    JupyterMessage,
    ProtocolViolation,
    Subscription,
)
from .codec import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, FrameError, FrameTooLarge, encode_frame

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "AgentClient",
    "AgentError",
    "ChannelClosed",
    "ChannelError",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "JupyterMessage",
    "ProtocolViolation",
    "Subscription",
    "encode_frame",
]
