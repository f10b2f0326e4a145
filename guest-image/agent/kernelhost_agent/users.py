"""``set_user``: the sandbox's code runs as an account of the image from now on (capability
``users``; what that changes is in ``accounts.py``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .accounts import Account, lookup
from .bash import Bash
from .config import AgentConfig
from .dispatch import Handler
from .kernel import Kernel
from .shared import log, protocol

__all__ = ["Users"]


class Users:
    """The users area."""

    capability = protocol.Capability.USERS

    def __init__(self, config: AgentConfig, kernel: Kernel, bash: Bash) -> None:
        self.config = config
        self.kernel = kernel
        self.bash = bash

    def ops(self) -> Mapping[str, Handler]:
        return {protocol.Op.SET_USER: self.op_set_user}

    async def op_set_user(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Make ``user`` the sandbox's: its kernel (in place, or restarted as it), the kernels,
        commands and files to come. Chosen once: a kernel that dropped root cannot take it back,
        so another user than the one set is refused (the same one again is a no-op)."""
        account = lookup(frame.get("user"))
        identity = self.config.identity
        current = identity.account
        if current is not None or account.uid == 0:
            if current == account or (current is None and account.uid == 0):
                return _describe(account)
            raise ValueError(
                f"this sandbox's code runs as {current.name if current else 'root'!r} already; "
                "a sandbox's user is chosen once, when it starts"
            )
        identity.account = account
        os.makedirs(self.config.bash_dir, mode=0o700, exist_ok=True)
        for path in (self.config.kernel_cwd, self.config.bash_dir, account.home):
            if os.path.isdir(path):
                account.own(path)
        self.bash.renew_standby()  # the waiting bash is root's
        if self.config.start_kernel:
            await self.kernel.until_ready()
            await self.kernel.become(account)
        log(f"the sandbox's code runs as {account.name} (uid {account.uid}) from now on")
        return _describe(account)


def _describe(account: Account) -> dict[str, Any]:
    return {"user": account.name, "uid": account.uid, "gid": account.gid, "home": account.home}
