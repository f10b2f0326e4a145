"""The wire protocol between the host service and the guest agent.

``codec`` is the sans-IO frame codec and ``protocol`` the op names, capabilities and constants,
both shared verbatim with the guest; ``client`` is the host's asyncio client of one VM's agent.
"""

from . import protocol
from .client import (
    AgentClient,
    AgentError,
    AgentInfo,
    ChannelClosed,
    ChannelError,
    ChannelListener,
    ChannelTimeout,
    JupyterMessage,
    NotSupportedByAgent,
    ProtocolViolation,
    Subscription,
)
from .codec import DEFAULT_MAX_FRAME_BYTES, FrameDecoder, FrameError, FrameTooLarge, encode_frame
from .protocol import Capability, Event, Frame, NetFrame, Op

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "AgentClient",
    "AgentError",
    "AgentInfo",
    "Capability",
    "ChannelClosed",
    "ChannelError",
    "ChannelListener",
    "ChannelTimeout",
    "Event",
    "Frame",
    "FrameDecoder",
    "FrameError",
    "FrameTooLarge",
    "JupyterMessage",
    "NetFrame",
    "NotSupportedByAgent",
    "Op",
    "ProtocolViolation",
    "Subscription",
    "encode_frame",
    "protocol",
]
