"""The OpenAPI document matches the routes the service really has."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.api.v1.openapi import document
from kernelhost.config import Settings

from .offline import offline_settings

pytestmark = pytest.mark.unit

# Served but documented elsewhere: the Kernel Gateway API (docs/jupyter.md), MCP
# (docs/integrations.md), E2B's APIs (docs/e2b.md), Prometheus metrics, the web console (/,
# /console.*) and the document itself.
UNDOCUMENTED_PREFIXES = (
    "/api/", "/kernelspecs/", "/mcp", "/metrics", "/openapi.json", "/static", "/console", "/e2b/",
    "/files",  # E2B's signed file URLs (docs/e2b.md), which the SDKs put at the root
)  # fmt: skip


def _app_routes(tmp_path: Path) -> set[tuple[str, str]]:
    settings = Settings.load({}, state_dir=tmp_path, api_keys=("unit-test-key-0123456789",))
    app = init_app(settings)
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter") or info.get("prefix")
        if not path or route.method in ("HEAD", "*", "OPTIONS"):
            continue
        if path == "/" or path.startswith(UNDOCUMENTED_PREFIXES):
            continue
        out.add((route.method.lower(), path))
    return out


def test_every_route_is_documented_and_every_operation_exists(tmp_path: Path) -> None:
    doc = document()
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert _app_routes(tmp_path) == documented


async def test_openapi_json_is_served_without_a_key(tmp_path: Path) -> None:
    settings = offline_settings(tmp_path, pool_size=0, api_keys=("unit-test-key-0123456789",))
    async with TestClient(TestServer(init_app(settings))) as c:
        r = await c.get("/openapi.json")
        assert r.status == 200
        body = await r.json()
        assert body["openapi"].startswith("3.") and "/v1/sandboxes" in body["paths"]
