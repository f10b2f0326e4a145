"""The E2B surface's own parts, offline: the Connect codec (sans-IO), the error shapes and
auth checks of /e2b on libvirt's test driver, and snapshots (kept checkpoints: their wire, their
lifetime, the builds prune keeps for them) with records put in place (no VM: a sandbox call
needs one, the tests under tests/clients/agents/test_e2b.py make them)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hypervisor import ImageStore
from kernelhost.api import init_app
from kernelhost.api.auth import key_id
from kernelhost.api.e2b.connect import ConnectError, end_stream, envelope, parse_stream_request
from kernelhost.api.e2b.process import command_line, script
from kernelhost.api.state import RUNTIME
from kernelhost.config import ConfigError, Settings
from kernelhost.sandboxes.checkpoints.service import Checkpoints
from kernelhost.sandboxes.store.checkpoints import CheckpointRecord, CheckpointStore
from kernelhost.sandboxes.store.db import SQLite
from kernelhost.sandboxes.store.sandboxes import Store
from kernelhost.sandboxes.vm.prune import BY_CHECKPOINT, InUse, Reference, referenced_builds, stale_images

from .e2b_support import KEY, ApiClient, put_kept
from .e2b_support import client as client  # the fixture: pytest finds it by its name
from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit


def test_envelopes_round_trip_and_the_end_of_stream_carries_the_error() -> None:
    frame = envelope({"event": {"start": {"pid": 7}}})
    assert frame[0] == 0 and struct.unpack(">I", frame[1:5])[0] == len(frame) - 5
    assert parse_stream_request(frame) == {"event": {"start": {"pid": 7}}}
    end = end_stream(ConnectError("deadline_exceeded", "too slow"))
    assert end[0] == 0x02 and json.loads(end[5:]) == {
        "error": {"code": "deadline_exceeded", "message": "too slow"}
    }
    assert json.loads(end_stream()[5:]) == {}


@pytest.mark.parametrize(
    "body, says",
    [
        (b"\x00\x00", "not an enveloped"),
        (b"\x01\x00\x00\x00\x02{}", "compressed"),
        (struct.pack(">BI", 0, 50) + b"{}", "truncated"),
        (struct.pack(">BI", 0, 2) + b"[]", "JSON object"),
    ],
)
def test_bad_stream_requests_are_named(body: bytes, says: str) -> None:
    with pytest.raises(ConnectError, match=says):
        parse_stream_request(body)


def test_commands_run_as_e2b_sends_them_in_a_subshell_of_their_own() -> None:
    assert command_line({"cmd": "/bin/bash", "args": ["-l", "-c", "echo $A"]}) == "echo $A"
    assert command_line({"cmd": "ls", "args": ["-l", "a b"]}) == "ls -l 'a b'"
    body = script({"cmd": "/bin/bash", "args": ["-l", "-c", "pwd"], "cwd": "/tmp x", "envs": {"A": "1 2"}})
    assert body == "(\nexport HOME=/home/user\ncd -- '/tmp x' || exit 1\nexport A='1 2'\npwd\n)"
    with pytest.raises(ConnectError, match="not valid"):
        script({"cmd": "true", "envs": {"A-B": "x"}})


async def test_lifecycle_errors_are_e2b_shaped(client: ApiClient) -> None:
    r = await client.post("/e2b/v2/sandboxes", json={})
    assert r.status == 401 and (await r.json())["code"] == 401 and r.headers["Should-Retry"] == "false"
    headers = {"X-API-KEY": KEY}
    r = await client.get("/e2b/sandboxes/sbx_0000000000000000", headers=headers)
    assert r.status == 404 and set(await r.json()) == {"code", "message"}
    r = await client.get("/e2b/volumes", headers=headers)
    assert r.status == 501 and "volumes" in (await r.json())["message"]
    r = await client.get("/e2b/no/such/thing", headers=headers)
    assert r.status == 404 and "not part of kernelhost's E2B surface" in (await r.json())["message"]
    r = await client.post("/e2b/v2/sandboxes", json={"templateID": 5}, headers=headers)
    assert r.status == 400 and "templateID" in (await r.json())["message"]


async def test_in_sandbox_calls_need_a_known_sandbox(client: ApiClient) -> None:
    # E2B's proxy: 502 "was not found" for a sandbox that does not run, or is not the caller's
    r = await client.get("/e2b/sandbox/health")
    assert r.status == 502 and "was not found" in (await r.json())["message"]
    r = await client.get("/e2b/sandbox/health", headers={"E2b-Sandbox-Id": "sbx_nope", "X-Access-Token": "x"})
    assert r.status == 502 and (await r.json())["sandboxId"] == "sbx_nope"
    r = await client.get("/e2b/sandbox/files", params={"path": "/x"})
    assert r.status == 404 and "E2B_SANDBOX_URL" in (await r.json())["message"]
    r = await client.post(
        "/e2b/sandbox/filesystem.Filesystem/Stat", json={}, headers={"E2b-Sandbox-Id": "sbx_nope"}
    )
    assert r.status == 404 and (await r.json())["code"] == "not_found"


# == snapshots: kept checkpoints (no VM: their records and files are put in place) ==============


async def test_snapshots_list_filter_paginate_and_delete_as_e2b_sdks_expect(client: ApiClient) -> None:
    headers = {"X-API-KEY": KEY}
    plain = put_kept(client, "sbx_gone00000000001")
    named = put_kept(client, "sbx_gone00000000002", label="my-snap")
    put_kept(client, "sbx_gone00000000002", keep=False)  # a checkpoint, not a snapshot
    put_kept(client, "sbx_gone00000000003", owner="key_someoneelse")
    r = await client.get("/e2b/snapshots", headers=headers)
    assert r.status == 200 and "x-next-token" not in r.headers
    assert await r.json() == [
        {"snapshotID": plain.id, "names": []},
        {"snapshotID": "my-snap", "names": ["my-snap"]},
    ]
    r = await client.get("/e2b/snapshots", params={"limit": "1"}, headers=headers)
    assert [s["snapshotID"] for s in await r.json()] == [plain.id] and r.headers["x-next-token"] == "1"
    r = await client.get("/e2b/snapshots", params={"limit": "1", "nextToken": "1"}, headers=headers)
    assert [s["snapshotID"] for s in await r.json()] == ["my-snap"] and "x-next-token" not in r.headers
    for query, want in (
        ({"sandboxID": "sbx_gone00000000002"}, ["my-snap"]),
        ({"name": "my-snap"}, ["my-snap"]),
        ({"name": named.id}, ["my-snap"]),
        ({"name": "other"}, []),
    ):
        r = await client.get("/e2b/snapshots", params=query, headers=headers)
        assert [s["snapshotID"] for s in await r.json()] == want, query
    r = await client.get("/e2b/snapshots", params={"limit": "0"}, headers=headers)
    assert r.status == 400 and (await r.json())["code"] == 400

    # the SDKs delete a snapshot as a template: 204, then 404 (their False)
    r = await client.delete("/e2b/templates/my-snap", headers=headers)
    assert r.status == 204 and not Path(named.path).exists()
    r = await client.delete("/e2b/templates/my-snap", headers=headers)
    assert r.status == 404 and set(await r.json()) == {"code", "message"}
    r = await client.delete(f"/e2b/templates/{plain.id}", headers=headers)
    assert r.status == 204
    r = await client.delete("/e2b/templates/python", headers=headers)  # a real template: refused
    assert r.status == 501 and "/v1/templates/python" in (await r.json())["message"]
    r = await client.get("/e2b/templates/python", headers=headers)
    assert r.status == 501
    r = await client.get("/e2b/snapshots", headers=headers)
    assert await r.json() == []


async def test_snapshot_requests_are_checked_before_anything_is_taken(client: ApiClient) -> None:
    headers = {"X-API-KEY": KEY}
    url = "/e2b/sandboxes/sbx_0000000000000000/snapshots"
    for body, status, says in (
        ({"memory": False}, 400, 'mode="filesystem"'),
        ({"memory": "yes"}, 400, "true or false"),
        ({"name": "a b"}, 400, "no namespaces or tags"),
        ({"name": "team/snap:v1"}, 400, "no namespaces or tags"),
        ({"name": "python"}, 409, "name of a template"),
        ({"name": "code-interpreter-v1"}, 409, "name of a template"),
        ({"name": "fine"}, 404, "sbx_0000000000000000"),
    ):
        r = await client.post(url, json=body, headers=headers)
        got = await r.json()
        assert r.status == status and got["code"] == status and says in got["message"], (body, got)
    # a create naming an unknown checkpoint, or another key's, is a 404, not a template lookup
    theirs = put_kept(client, "sbx_gone00000000004", owner="key_someoneelse")
    for template in ("cp_0000000000000000", theirs.id):
        r = await client.post("/e2b/v2/sandboxes", json={"templateID": template}, headers=headers)
        assert r.status == 404 and template in (await r.json())["message"]


async def test_a_sandbox_from_a_snapshot_gets_its_network_and_kept_ones_outlive_it(
    client: ApiClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The branch's VM is not started (no VM here): what the branch gets is its record's."""

    async def launched(self: Checkpoints, sbx: object, cp: object, image: object) -> None:
        return None

    monkeypatch.setattr(Checkpoints, "_launch", launched)
    headers = {"X-API-KEY": KEY}
    outbound = {"mode": "outbound", "allow": []}
    put_kept(client, "sbx_gone00000000005", label="online", network=outbound)
    manager = client.app[RUNTIME].manager
    r = await client.post("/e2b/v2/sandboxes", json={"templateID": "online"}, headers=headers)
    assert r.status == 201, await r.text()
    made = await r.json()
    sbx = manager.get(key_id(KEY), made["sandboxID"])
    assert sbx.record.network == outbound and made["envdAccessToken"].startswith("kh_")
    assert made["templateID"] == "python" and sbx.record.metadata["branched_from"].startswith("cp_")
    r = await client.post(
        "/e2b/v2/sandboxes", json={"templateID": "online", "allow_internet_access": False}, headers=headers
    )
    assert manager.get(key_id(KEY), (await r.json())["sandboxID"]).record.network["mode"] == "none"

    # deleting a sandbox deletes its checkpoints but for the kept ones
    kept = put_kept(client, sbx.id, label="kept")
    dropped = put_kept(client, sbx.id, keep=False)
    r = await client.delete(f"/e2b/sandboxes/{sbx.id}", headers=headers)
    assert r.status == 204
    ids = [c.id for c in manager.owner_checkpoints(key_id(KEY))]
    assert kept.id in ids and dropped.id not in ids
    assert Path(kept.path).is_file() and not Path(dropped.path).exists()


async def test_kept_checkpoints_survive_the_start_up_clean_up(tmp_path: Path) -> None:
    settings = offline_settings(tmp_path, image_dir=fake_image_dir(tmp_path), pool_size=0, api_keys=(KEY,))
    async with TestClient(TestServer(init_app(settings))) as first:
        kept = put_kept(first, "sbx_gone00000000006", label="stays")
        orphan = put_kept(first, "sbx_gone00000000006", keep=False)
    async with TestClient(TestServer(init_app(settings))) as second:
        left = second.app[RUNTIME].manager.owner_checkpoints(key_id(KEY))
        assert [c.id for c in left] == [kept.id] and left[0].keep and left[0].label == "stays"
        assert Path(kept.path).is_file() and not Path(orphan.path).exists()
        r = await second.get("/e2b/snapshots", headers={"X-API-KEY": KEY})
        assert await r.json() == [{"snapshotID": "stays", "names": ["stays"]}]


def test_an_older_checkpoint_table_gains_keep_and_network(tmp_path: Path) -> None:
    db = SQLite(tmp_path / "old.sqlite3")
    db.execute(
        "CREATE TABLE checkpoints (id TEXT PRIMARY KEY, sandbox_id TEXT NOT NULL, owner TEXT NOT NULL, "
        "label TEXT NOT NULL DEFAULT '', auto INTEGER NOT NULL DEFAULT 0, call_index INTEGER NOT NULL "
        "DEFAULT 0, created_at REAL NOT NULL, bytes INTEGER NOT NULL DEFAULT 0, template TEXT NOT NULL, "
        "image_key TEXT NOT NULL, base TEXT NOT NULL DEFAULT '{}', path TEXT NOT NULL)"
    )
    db.execute(
        "INSERT INTO checkpoints (id, sandbox_id, owner, created_at, template, image_key, path) "
        "VALUES ('cp_00000000000000aa', 'sbx_1', 'key_1', 1.0, 'python', 'k1', '/x.zst')"
    )
    store = CheckpointStore(db)
    old = store.get("cp_00000000000000aa")
    assert old is not None and old.keep is False and old.network == {}
    assert store.of_owner("key_1", kept_only=True) == []
    assert [c.id for c in store.of_owner("key_1")] == [old.id]


def test_prune_keeps_the_builds_checkpoints_name(tmp_path: Path) -> None:
    images = fake_image_dir(tmp_path)  # python-k1, current
    for key in ("old", "gone"):
        (images / f"python-{key}").mkdir()
        (images / f"python-{key}" / "rootfs.erofs").write_bytes(b"r" * 4096)
    db_path = tmp_path / "state" / "kernelhost.sqlite3"
    store = Store(db_path)
    CheckpointStore(store.db).insert(
        CheckpointRecord(
            id="cp_00000000000000bb",
            sandbox_id="sbx_gone",
            owner="key_1",
            template="python",
            image_key="old",
            path="/x.zst",
            keep=True,
        )
    )
    store.close()
    refs = referenced_builds(db_path)
    assert refs == [Reference("python", "old", BY_CHECKPOINT)]
    plan = stale_images(ImageStore(images), refs, InUse())
    assert [a.path.name for a in plan.remove] == ["python-gone"]
    assert [(a.path.name, why) for a, why in plan.keep] == [("python-old", BY_CHECKPOINT)]


@pytest.mark.parametrize(
    "name, value",
    [
        ("body_timeout", "0"),
        ("max_processes_per_sandbox", "0"),
        ("max_processes_per_key", "0"),
        ("max_list_entries", "0"),
    ],
)
def test_the_new_limits_are_validated_and_documented(name: str, value: str) -> None:
    with pytest.raises(ConfigError, match=name):
        Settings.load({f"KERNELHOST_{name.upper()}": value})
    docs = Path(__file__).resolve().parents[2] / "docs"
    for page in ("configuration.md", "limits.md"):
        assert f"`{name}`" in (docs / page).read_text(), (name, page)


async def test_e2b_template_names_start_the_templates_the_setting_names(tmp_path: Path) -> None:
    """``code-interpreter-v1`` is the data-science built-in by default (this image dir has only
    ``python``, so the create names the template it looked for); the operator can point it
    elsewhere, and a malformed entry is refused at start naming it."""
    images = fake_image_dir(tmp_path)
    for mapping, wanted in (((), "python-datasci"), (("code-interpreter-v1=custom-ds",), "custom-ds")):
        extra = {"e2b_templates": mapping} if mapping else {}
        settings = offline_settings(tmp_path, image_dir=images, pool_size=0, api_keys=(KEY,), **extra)
        async with TestClient(TestServer(init_app(settings))) as c:
            r = await c.post(
                "/e2b/v2/sandboxes", json={"templateID": "code-interpreter-v1"}, headers={"X-API-KEY": KEY}
            )
            assert r.status == 400 and f"unknown template {wanted!r}" in (await r.json())["message"]
    assert Settings.load({"KERNELHOST_E2B_TEMPLATES": "base=python, x=y"}).e2b_template_map == {
        "base": "python",
        "x": "y",
    }
    with pytest.raises(ConfigError, match=r"e2b_templates has the entry 'code-interpreter-v1'"):
        Settings.load({"KERNELHOST_E2B_TEMPLATES": "code-interpreter-v1"})
