"""The E2B surface's details that programs lean on, offline: E2B's signed-URL signature against
the SDK's own, envd's permissions strings (Go's ``FileMode.String``), tokens the service can
derive again from its key, the quotes a string result loses, and the refusals of signed URLs
that do not check out (no VM: tests/clients/agents/test_e2b_fidelity.py drives real ones)."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import pytest
from e2b.sandbox.signature import get_signature

from kernelhost.api.e2b.entries import permissions, wire_entry
from kernelhost.api.e2b.interpreter import result_line, strip_quotes
from kernelhost.api.e2b.signed import signature
from kernelhost.sandboxes import Result
from kernelhost.sandboxes.access import load_token_key, new_access_token, token_matches, tokens_of

from .e2b_support import ApiClient
from .e2b_support import client as client  # the fixture: pytest finds it by its name

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("expiration", [None, 60])
@pytest.mark.parametrize("user", [None, "user"])
def test_signatures_are_the_sdks(expiration: int | None, user: str | None) -> None:
    theirs = get_signature("/home/user/a b.txt", "read", user, "kh_sbx_token", expiration)
    ours = signature("/home/user/a b.txt", "read", user or "", "kh_sbx_token", theirs["expiration"])
    assert ours == theirs["signature"]
    assert signature("/home/user/a b.txt", "write", user or "", "kh_sbx_token", theirs["expiration"]) != ours


@pytest.mark.parametrize(
    "mode, shown",
    [
        (stat.S_IFREG | 0o644, "-rw-r--r--"),
        (stat.S_IFDIR | 0o755, "drwxr-xr-x"),
        (stat.S_IFLNK | 0o777, "Lrwxrwxrwx"),
        (stat.S_IFDIR | stat.S_ISVTX | 0o777, "dtrwxrwxrwx"),
        (stat.S_IFREG | stat.S_ISUID | 0o755, "urwxr-xr-x"),  # Go: a letter, so no "-"
        (stat.S_IFCHR | 0o666, "Dcrw-rw-rw-"),
        (stat.S_IFIFO | 0o600, "prw-------"),
    ],
)
def test_permissions_are_gos_file_mode_strings(mode: int, shown: str) -> None:
    assert permissions(mode) == shown


def test_an_entry_is_envds_entry_info() -> None:
    mtime = 1_700_000_000_123_456_789
    link = wire_entry(
        {"path": "/home/user/l", "size": 5, "st_mode": stat.S_IFLNK | 0o777, "mtime_ns": mtime,
         "owner": "root", "group": "root", "type": "file", "perm": 0o644, "target": "/home/user/b.txt"}
    )  # fmt: skip
    assert link == {
        "name": "l",
        "type": "FILE_TYPE_FILE",
        "path": "/home/user/l",
        "size": "5",
        "mode": 0o644,
        "permissions": "Lrwxrwxrwx",
        "owner": "root",
        "group": "root",
        "modifiedTime": "2023-11-14T22:13:20.123456789Z",
        "isSymlink": True,
        "symlinkTarget": "/home/user/b.txt",
    }
    with pytest.raises(ValueError):
        wire_entry({"path": 5})


def test_tokens_derive_again_from_the_key_alone(tmp_path: Path) -> None:
    key = load_token_key(tmp_path)
    assert load_token_key(tmp_path) == key and (tmp_path / "access-token-key").stat().st_mode & 0o077 == 0
    token, kept = new_access_token(key, "sbx_a")
    assert token_matches([kept], token) and "." in kept and token not in kept
    assert tokens_of(key, "sbx_a", [kept, "oldhash"]) == [token]
    assert tokens_of(key, "sbx_b", [kept]) != [token]  # bound to its sandbox
    assert load_token_key(tmp_path, "a cluster secret of enough length") != key


def test_a_string_result_loses_one_pair_of_quotes() -> None:
    assert strip_quotes("'value'") == "value"
    assert strip_quotes('"it\'s"') == '"it\'s"' and strip_quotes("42") == "42"
    assert strip_quotes("'a' + 'b'") == "a' + 'b"  # E2B's rule: the first and the last character
    line = result_line(Result({"text/plain": "'hi'", "text/html": "'x'"}, is_main_result=True))
    assert line["text"] == "hi" and line["html"] == "'x'"


def test_the_kernels_e2b_formats_are_the_results_data_and_chart() -> None:
    chart = {"type": "line", "title": "T", "elements": []}
    line = result_line(Result({"e2b/data": {"a": [1, 2]}, "e2b/chart": chart}, is_main_result=False))
    assert line["data"] == {"a": [1, 2]} and line["chart"] == chart and "extra" not in line


async def test_signed_urls_that_do_not_check_out_are_refused(client: ApiClient) -> None:
    r = await client.get("/files", params={"path": "/etc/passwd"})
    assert r.status == 401 and "signature" in (await r.json())["message"]
    forged = {"path": "/etc/passwd", "signature": signature("/etc/passwd", "read", "", "guess", None)}
    r = await client.get("/files", params=forged)
    assert r.status == 401 and "does not match" in (await r.json())["message"]
    expired = {**forged, "signature_expiration": str(int(time.time()) - 5)}
    r = await client.get("/files", params=expired)
    assert r.status == 401 and "expired" in (await r.json())["message"]
    r = await client.put("/files", params=forged)  # neither read nor write
    assert r.status == 401
