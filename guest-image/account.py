"""The account E2B's images have, in every built-in image (guest-image/build.py): ``user``.

Standard library only, like build.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

#: ``run(argv, **kw)`` of build.py
Run = Callable[..., Any]


def add_user(root: Path, run: Run) -> None:
    """The account E2B's images have: ``user`` (uid 1000), home /home/user, sudo without a
    password. A sandbox's code runs as root until the host names a user (``set_user``: E2B's
    sandboxes); the home is the user's, and stays empty (a sandbox of root lists nothing there):
    the agent makes the user's site-packages and cache when it is named."""
    home = root / "home" / "user"
    home.mkdir(parents=True, exist_ok=True)
    run(
        ["chroot", str(root), "useradd", "--uid", "1000", "--user-group", "--groups", "sudo",
         "--home-dir", "/home/user", "--no-create-home", "--shell", "/bin/bash", "user"]
    )  # fmt: skip
    sudoers = root / "etc" / "sudoers.d" / "user"
    sudoers.parent.mkdir(parents=True, exist_ok=True)
    sudoers.write_text("user ALL=(ALL:ALL) NOPASSWD: ALL\n")
    sudoers.chmod(0o440)
    run(["chroot", str(root), "chown", "user:user", "/home/user"])
