"""Whose the sandbox's code is: root (the default), or an account of the image (``set_user``).

A sandbox's user is chosen once, when the host hands the VM over (E2B's sandboxes run their
code as ``user``, whose sudo needs no password, as E2B's own images do). From then on:

- the main kernel runs as that user: a Python kernel drops root in place (one silent cell: the
  process, its imports and its state stay), any other kernel is restarted as the user;
- every kernel started later (a restart, the standby, a code context) is launched as the user,
  its connection file handed to it (``AccountKernelManager``);
- bash commands run as the user, unless a request names ``root``;
- files the agent writes for the host (``fs_write``) belong to the user, or to the one named.

Nothing here is a boundary: the user's sudo makes it root at will. It is what programs expect
(``whoami``, ``~``, ``pip install`` into ``~/.local``, files a command and the kernel can both
change). The agent itself stays root.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
from collections.abc import Mapping
from typing import Any

from jupyter_client.manager import AsyncKernelManager

__all__ = ["ROOT", "Account", "AccountKernelManager", "Identity", "lookup"]

NAME_MAX = 32


@dataclasses.dataclass(frozen=True)
class Account:
    """A user of the image, as processes are started under it."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    def environ(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this user's HOME, USER and LOGNAME."""
        return {**env, "HOME": self.home, "USER": self.name, "LOGNAME": self.name}

    def popen(self) -> dict[str, Any]:
        """subprocess.Popen's arguments that start a process as this user."""
        return {"user": self.uid, "group": self.gid, "extra_groups": list(self.groups)}

    def own(self, path: str) -> None:
        """Give ``path`` (not what it holds) to this user; a path that is gone is left."""
        with contextlib.suppress(FileNotFoundError):
            os.chown(path, self.uid, self.gid, follow_symlinks=False)


ROOT = Account("root", 0, 0, (0,), "/root")


def lookup(name: object) -> Account:
    """The account called ``name`` in this image (ValueError naming it if there is none)."""
    if not isinstance(name, str) or not name or len(name) > NAME_MAX or "\0" in name:
        raise ValueError(f"user must be a user name of at most {NAME_MAX} characters, got {name!r:.40}")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(
            f"no user {name!r} in this sandbox's image; use 'root' or 'user' (every built-in "
            "image has both), or add the account in the template's setup"
        ) from None
    return Account(name, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(name, pw.pw_gid)), pw.pw_dir)


class Identity:
    """The sandbox's user, shared by every area and every copy of the agent's configuration
    (a code context's): None while it is root."""

    def __init__(self) -> None:
        self.account: Account | None = None

    def resolve(self, name: object) -> Account | None:
        """The account a request names (None or missing: the sandbox's; ``root``: None)."""
        if name is None:
            return self.account
        account = lookup(name)
        return None if account.uid == 0 else account


class AccountKernelManager(AsyncKernelManager):
    """jupyter_client's manager, launching its kernel as the sandbox's user when it has one:
    each launch (a start, a restart) reads the identity then, so a kernel of a sandbox whose user
    was set later is the user's too."""

    kh_identity: Identity | None = None

    async def _async_launch_kernel(self, kernel_cmd: list[str], **kw: Any) -> None:
        account = self.kh_identity.account if self.kh_identity is not None else None
        if account is not None:
            account.own(self.connection_file)  # written by the agent (0600): the kernel reads it
            kw = {**kw, **account.popen(), "env": account.environ(kw.get("env") or os.environ)}
        await super()._async_launch_kernel(kernel_cmd, **kw)

    # jupyter_client 7 (Debian 12's) starts and restarts through ``_launch_kernel``, bound in
    # AsyncKernelManager to the base class's function; 8 calls ``_async_launch_kernel`` by name
    _launch_kernel = _async_launch_kernel
