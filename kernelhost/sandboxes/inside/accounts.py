"""Whose a sandbox's code is: the account of its image its record names (``run_as``), told to the
guest when the sandbox gets its VM (``set_user``). Root, the default, is told nothing.

E2B's sandboxes run their code as ``user`` (uid 1000, ``/home/user``, sudo without a password),
as E2B's own images do; the agent then runs the kernel, later kernels, commands and the files it
writes as that user (guest-image/agent/kernelhost_agent/accounts.py). The guest keeps it in its
memory, so a wake, a fork, a checkpoint's branch and a re-attached VM keep it; a VM booted afresh
(a create, a replacement) is told again.
"""

from __future__ import annotations

from ...channel import ChannelError, NotSupportedByAgent
from ...channel.protocol import Op
from ..errors import AgentUnresponsive, NotSupportedByImage
from ..sandbox import Sandbox

__all__ = ["set_user"]


async def set_user(sbx: Sandbox, timeout: float) -> None:
    """Tell the sandbox's guest the account its code runs as (nothing for root); raises
    ``NotSupportedByImage`` for an image without accounts, ``AgentUnresponsive`` otherwise."""
    user, agent = sbx.record.run_as, sbx.agent
    if not user or agent is None:
        return
    try:
        await agent.request(Op.SET_USER, timeout=timeout, user=user)
    except NotSupportedByAgent as exc:
        raise NotSupportedByImage(
            f"the guest image of template {sbx.record.template!r} cannot run code as {user!r}; "
            "rebuild the images (make image) and create the sandbox again"
        ) from exc
    except ChannelError as exc:
        raise AgentUnresponsive(
            f"sandbox {sbx.id}: its agent did not make {user!r} the sandbox's user: "
            f"{exc or type(exc).__name__}",
            sandbox_id=sbx.id,
        ) from exc
