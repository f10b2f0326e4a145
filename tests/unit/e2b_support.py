"""What the offline E2B tests share: the app on libvirt's test driver with one key, and a
kept checkpoint (an E2B snapshot) put in place as taking one leaves it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.api.auth import key_id
from kernelhost.api.state import RUNTIME
from kernelhost.sandboxes.store.checkpoints import CheckpointRecord, CheckpointStore, new_checkpoint_id

from .offline import fake_image_dir, offline_settings

ApiClient = TestClient[web.Request, web.Application]
KEY = "unit-test-key-0123456789"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(tmp_path, image_dir=fake_image_dir(tmp_path), pool_size=0, api_keys=(KEY,))
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


def put_kept(
    client: ApiClient,
    sandbox_id: str,
    *,
    keep: bool = True,
    label: str = "",
    owner: str | None = None,
    network: dict[str, Any] | None = None,
) -> CheckpointRecord:
    """A checkpoint record and its file, as taking one leaves them."""
    rt = client.app[RUNTIME]
    cid = new_checkpoint_id()
    path = rt.settings.checkpoint_dir / sandbox_id / f"{cid}.zst"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"z" * 100)
    cp = CheckpointRecord(
        id=cid,
        sandbox_id=sandbox_id,
        owner=owner or key_id(KEY),
        template="python",
        image_key="k1",
        path=str(path),
        label=label,
        bytes=100,
        keep=keep,
        network=network or {},
        created_at=time.time() + len(CheckpointStore(rt.store.db).all()),  # distinct, in order
    )
    CheckpointStore(rt.store.db).insert(cp)
    return cp
