"""/v1/templates without a VM: the spec's errors name the field, the built-ins are listed, a
key's template is invisible to others, a bad files archive is refused before anything runs.
Builds themselves run through real images in tests/vm/test_templates.py."""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.archive import ArchiveError, local_files, pack_files

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]

KEY = "unit-test-key-0123456789"
OTHER = "other-test-key-0123456789"


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(
        tmp_path, image_dir=fake_image_dir(tmp_path), snapshots="off", pool_size=0, api_keys=(KEY, OTHER)
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


async def test_the_builtins_are_listed_and_unknown_names_are_404(client: ApiClient) -> None:
    r = await client.get("/v1/templates", headers=auth())
    assert r.status == 200
    (python,) = (await r.json())["templates"]
    assert (python["name"], python["kind"], python["state"]) == ("python", "builtin", "ready")
    r = await client.get("/v1/templates/nope", headers=auth())
    assert r.status == 404
    err = (await r.json())["error"]
    assert err["code"] == "template_not_found" and "python" in err["message"]
    assert "GET /v1/templates" in err["hint"]
    r = await client.delete("/v1/templates/python", headers=auth())
    assert r.status == 409 and "not this key's" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"name": "Bad"}, "name"),
        ({"name": "ml", "pip": "numpy"}, "pip"),
        ({"name": "ml", "base": "nope"}, "base"),
        ({"name": "python"}, "name"),
        ({"name": "ml", "memory_mib": 1}, "memory_mib"),
        ({"name": "ml", "colour": "red"}, "colour"),
    ],
)
async def test_a_bad_spec_is_a_400_naming_the_field(
    client: ApiClient, spec: dict[str, object], field: str
) -> None:
    r = await client.post("/v1/templates", json=spec, headers=auth())
    assert r.status == 400
    err = (await r.json())["error"]
    assert err["field"] == field and field in err["message"]


@pytest.mark.parametrize("mode", ["w", "w:bz2", "w:xz"])
async def test_a_files_archive_that_is_not_gzip_is_refused_unopened(
    client: ApiClient, mode: Literal["w", "w:bz2", "w:xz"]
) -> None:
    """Only a tar.gz goes to a build VM; the host reads nothing of it but its first two bytes
    (its members, such as this one leaving its root, are checked in the VM)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        info = tarfile.TarInfo("../../etc/passwd")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    form = aiohttp.FormData()
    form.add_field("spec", json.dumps({"name": "evil"}), content_type="application/json")
    form.add_field("files", buf.getvalue(), filename="f.tar")
    r = await client.post("/v1/templates", data=form, headers=auth())
    assert r.status == 400
    error = (await r.json())["error"]
    assert error["field"] == "files" and "not gzip-compressed" in error["message"], error
    r = await client.get("/v1/templates/evil", headers=auth())
    assert r.status == 404  # nothing was recorded


async def test_multipart_without_a_spec_part_is_a_400(client: ApiClient) -> None:
    form = aiohttp.FormData()
    form.add_field("files", b"x", filename="f.tar")
    r = await client.post("/v1/templates", data=form, headers=auth())
    assert r.status == 400 and (await r.json())["error"]["field"] == "spec"


def test_archives_pack_guest_paths_as_gzip_and_refuse_links(tmp_path: Path) -> None:
    (tmp_path / "src" / "sub").mkdir(parents=True)
    (tmp_path / "src" / "sub" / "a.txt").write_text("a")
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    entries = local_files(["run.sh", {"src": "src", "dest": "/opt/app"}], tmp_path)
    assert entries[0] == (tmp_path / "run.sh", "/home/user/run.sh")
    packed = pack_files(entries)
    assert packed[:2] == b"\x1f\x8b" and packed == pack_files(entries)  # gzip, reproducible
    with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as archive:  # the test reads it
        members = {m.name: m for m in archive}
    assert {"home/user/run.sh", "opt/app/sub/a.txt"} <= set(members)
    assert members["home/user/run.sh"].mode & 0o111
    (tmp_path / "link").symlink_to(tmp_path / "run.sh")
    with pytest.raises(ArchiveError, match="is a link"):
        pack_files([(tmp_path / "link", "/x")])
    with pytest.raises(ArchiveError, match="absolute guest path"):
        local_files([{"src": "run.sh", "dest": "relative"}], tmp_path)


async def test_a_key_holds_at_most_max_templates_per_key(tmp_path: Path) -> None:
    settings = offline_settings(
        tmp_path,
        image_dir=fake_image_dir(tmp_path),
        snapshots="off",
        pool_size=0,
        api_keys=(KEY, OTHER),
        max_templates_per_key=1,
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        r = await c.post("/v1/templates", json={"name": "one"}, headers=auth())
        assert r.status == 202, await r.text()
        r = await c.post("/v1/templates", json={"name": "two"}, headers=auth())
        error = (await r.json())["error"]
        assert r.status == 429 and error["limit"] == "max_templates_per_key", error
        assert "delete one first" in error["message"]
        r = await c.post("/v1/templates", json={"name": "two"}, headers=auth(OTHER))  # its own limit
        assert r.status == 202, await r.text()
