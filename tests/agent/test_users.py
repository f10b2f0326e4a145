"""``set_user``: the sandbox's code runs as an account of the image (``accounts.py``).

Here the account is ``nobody``, which every Debian host has: after ``set_user`` the running kernel
has dropped root in place (its pid stays), bash commands run as it unless one names root, and
files the agent writes are its. The agent's directory is world-readable for this test (pytest's
own temporary directories are root's alone), and no standby kernel is started: this host's
Python lives under /root, which ``nobody`` cannot run. The guest runs E2B's ``user`` the same
way (tests/clients/agents/test_e2b_user.py).
"""

from __future__ import annotations

import os
import pwd
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kernelhost.channel import protocol

from .conftest import Running, running_agent
from .host import HostEnd
from .test_bash import bash

pytestmark = pytest.mark.unit

NOBODY = pwd.getpwnam("nobody")


@pytest.fixture(scope="module")
async def dropping() -> AsyncIterator[Running]:
    if os.geteuid() != 0:
        pytest.skip("dropping root needs root (the guest's agent runs as root)")
    root = Path(tempfile.mkdtemp(prefix="kh-users-", dir="/tmp"))
    root.chmod(0o755)
    try:
        async with running_agent(root, standby_kernel=False) as agent:
            yield agent
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def test_a_user_is_chosen_once_and_must_exist(host: HostEnd, running: Running) -> None:
    assert "users" in (await host.ok(protocol.Op.HELLO))["capabilities"]
    assert (await host.ok(protocol.Op.SET_USER, user="root"))["uid"] == 0  # root: as it is
    error = await host.refused(protocol.Op.SET_USER, user="no-such-user")
    assert "no user 'no-such-user' in this sandbox's image" in error
    assert "user must be a user name" in await host.refused(protocol.Op.SET_USER, user=7)
    assert running.config.identity.account is None  # nothing changed
    run = await bash(host, "id -u", user="root")
    assert run.streams["stdout"] == "0\n"
    refused = await host.request(protocol.Op.BASH, run_id="x1", command="true", user="nobody2")
    assert "no user 'nobody2'" in refused["error"]


async def test_the_kernel_commands_and_files_become_the_users(dropping: Running) -> None:
    host, config = dropping.host, dropping.config
    pid = (await host.execute("import os; print(os.getpid(), os.getuid())")).stream().split()[0]
    described = await host.ok(protocol.Op.SET_USER, user="nobody")
    fields = {k: described[k] for k in ("user", "uid", "gid", "home")}
    assert fields == {"user": "nobody", "uid": NOBODY.pw_uid, "gid": NOBODY.pw_gid, "home": NOBODY.pw_dir}
    shown = (await host.execute("print(os.getpid(), os.getuid(), os.environ['USER'])")).stream().split()
    assert shown == [pid, str(NOBODY.pw_uid), "nobody"]  # the same process, no longer root
    run = await bash(host, "id -un; echo $HOME; touch made-by-command; stat -c %u made-by-command")
    assert run.streams["stdout"].split() == ["nobody", NOBODY.pw_dir, str(NOBODY.pw_uid)], run.streams
    root_run = await bash(host, "id -u; echo $HOME", user="root")
    assert root_run.streams["stdout"].split() == ["0", "/root"]
    await host.ok(protocol.Op.FS_WRITE, path="new/dir/file.txt", offset=0, data=b"x", create=True)
    home = Path(config.kernel_cwd)
    assert {(home / p).stat().st_uid for p in ("new", "new/dir", "new/dir/file.txt")} == {NOBODY.pw_uid}
    await host.ok(protocol.Op.FS_WRITE, path="by-root.txt", offset=0, data=b"x", create=True, user="root")
    assert (home / "by-root.txt").stat().st_uid == 0
    again = await host.ok(protocol.Op.SET_USER, user="nobody")  # the same one: nothing to do
    assert again["uid"] == NOBODY.pw_uid
    assert "a sandbox's user is chosen once" in await host.refused(protocol.Op.SET_USER, user="root")
