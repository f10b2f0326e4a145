"""Whose an envd call is (``api/e2b/common.py:envd_user``): the E2B SDKs name a user with
``Authorization: Basic base64("<user>:")`` (``?username=`` on ``/files``), or none, which is the
sandbox's own (``user``); where a process of each starts (``api/e2b/process.py:script``); and
where a path of each lies (``envd_path``: envd's ``ExpandAndResolve``)."""

from __future__ import annotations

import base64
import os
import pwd
import subprocess
from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request

from kernelhost.api.e2b.common import envd_path, envd_user
from kernelhost.api.e2b.files import make_dir_script
from kernelhost.api.e2b.process import script
from kernelhost.sandboxes import InvalidRequest

pytestmark = pytest.mark.unit


def _basic(value: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(value.encode()).decode()}


@pytest.mark.parametrize(
    ("path", "headers", "expected"),
    [
        ("/process.Process/Start", {}, None),
        ("/process.Process/Start", _basic("root:"), "root"),
        ("/process.Process/Start", _basic("user:"), "user"),
        ("/files?path=a&username=root", {}, "root"),
        ("/files?path=a&username=user", _basic("root:"), "user"),  # the query names it first
        ("/process.Process/Start", {"Authorization": "Bearer k"}, None),  # an API key, no user
    ],
)
def test_the_user_an_envd_call_names(path: str, headers: dict[str, str], expected: str | None) -> None:
    assert envd_user(make_mocked_request("POST", path, headers=headers)) == expected


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        (
            _basic("nobody:"),
            "user 'nobody' does not exist in this sandbox; kernelhost's images have 'user' and 'root'",
        ),
        ({"Authorization": "Basic !!!"}, "is not Basic base64('<user>:')"),
    ],
)
def test_a_user_the_sandbox_lacks_is_named(headers: dict[str, str], message: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        envd_user(make_mocked_request("POST", "/process.Process/Start", headers=headers))
    assert message in refused.value.message and refused.value.details == {"field": "username"}


def test_a_process_starts_in_its_users_home() -> None:
    config = {"cmd": "/bin/bash", "args": ["-l", "-c", "pwd"]}
    assert "export HOME=/home/user\ncd -- /home/user " in script(config)
    assert "export HOME=/root\ncd -- /root " in script(config, "root")
    assert "cd -- /srv " in script({**config, "cwd": "/srv"}, "root")
    assert "cd -- /root/work " in script({**config, "cwd": "work"}, "root")
    assert "cd -- /home/user/work " in script({**config, "cwd": "~/work"})


@pytest.mark.parametrize(
    ("path", "user", "expected"),
    [
        ("notes.txt", None, "/home/user/notes.txt"),
        ("notes.txt", "user", "/home/user/notes.txt"),
        ("notes.txt", "root", "/root/notes.txt"),
        ("~", "root", "/root"),
        ("~/a/b", None, "/home/user/a/b"),
        ("a/../../etc/passwd", None, "/home/etc/passwd"),  # cleaned, as Go's filepath.Abs does
        ("/srv/./x", "root", "/srv/./x"),  # an absolute path is taken as it is
    ],
)
def test_a_path_lies_where_envd_puts_it_for_the_user(path: str, user: str | None, expected: str) -> None:
    assert envd_path(path, user) == expected


def test_another_users_home_is_refused_by_name() -> None:
    with pytest.raises(InvalidRequest, match=r"path '~bob/x' names another user's home; use an absolute"):
        envd_path("~bob/x", None)


def test_make_dir_makes_what_is_missing_anywhere_and_gives_it_to_the_user(tmp_path: Path) -> None:
    """envd's MakeDir: made through sudo (a stand-in here, as this host has none), the
    directories it made given to the caller's user (the ones that were there stay as they were);
    an existing path is exit code 17 (already_exists)."""
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "sudo").write_text('#!/bin/sh\n[ "$1" = -n ] && shift\nexec "$@"\n')
    (shim / "sudo").chmod(0o755)
    target = tmp_path / "work space" / "deep"
    script = make_dir_script(str(target), "nobody").replace("cd /home/user", f"cd {tmp_path}")
    env = {**os.environ, "PATH": f"{shim}:{os.environ['PATH']}"}
    assert subprocess.run(["bash", "-c", script], env=env, check=False).returncode == 0
    nobody = pwd.getpwnam("nobody").pw_uid
    assert [p.stat().st_uid for p in (target, target.parent, tmp_path)] == [nobody, nobody, 0]
    assert subprocess.run(["bash", "-c", script], env=env, check=False).returncode == 17
