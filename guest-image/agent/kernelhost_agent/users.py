"""``set_user``: the sandbox's code runs as an account of the image from now on (capability
``users``; what that changes is in ``accounts.py``)."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from .accounts import ROOT, Account, lookup
from .bash import Bash
from .config import AgentConfig
from .dispatch import Handler
from .kernel import Kernel
from .shared import log, protocol

__all__ = ["Users"]

#: caches under root's home the image's build made (guest-image/build.py: warm_up), copied for
#: a sandbox's user
CACHES = ("matplotlib",)


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
        await asyncio.to_thread(_prepare_home, account)
        self.bash.renew_standby()  # the waiting bash is root's
        if self.config.start_kernel:
            await self.kernel.until_ready()
            await self.kernel.become(account)
        log(f"the sandbox's code runs as {account.name} (uid {account.uid}) from now on")
        return _describe(account)


def _prepare_home(account: Account) -> None:
    """What the image made for root, made for the user too: the site-packages directory a
    Python started as the user puts on its path only if it exists then (``pip install`` as the
    user fills it later), and the caches the image's build left in root's home (matplotlib's
    font list: without it a kernel's first ``import matplotlib`` rebuilds it for seconds)."""
    if not os.path.isdir(account.home):  # an account without a home (nobody's /nonexistent)
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    os.makedirs(os.path.join(account.home, ".local", "lib", version, "site-packages"), exist_ok=True)
    for name in CACHES:
        source, target = os.path.join(ROOT.home, ".cache", name), os.path.join(account.home, ".cache", name)
        if os.path.isdir(source) and not os.path.exists(target):
            shutil.copytree(source, target, symlinks=True)
    for top in {os.path.join(account.home, ".local"), os.path.join(account.home, ".cache")}:
        for directory, _, files in os.walk(top):
            account.own(directory)
            for file in files:
                account.own(os.path.join(directory, file))


def _describe(account: Account) -> dict[str, Any]:
    return {"user": account.name, "uid": account.uid, "gid": account.gid, "home": account.home}
