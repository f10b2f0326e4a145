"""The HTTP layer on libvirt's test driver: auth, error mapping, validation, failed boots.

No QEMU runs here: the test driver "starts" domains that never open a channel, so a create
exercises the boot-failure path, which must leave no record, domain or file behind.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost.api import init_app
from kernelhost.config import ConfigError, Settings

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]  # aiohttp's test client over the service's app

KEY = "unit-test-key-0123456789"
OTHER = "other-test-key-0123456789"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(
        tmp_path, image_dir=fake_image_dir(tmp_path), boot_timeout=1.0, pool_size=0, api_keys=(KEY, OTHER)
    )
    app = init_app(settings)
    async with TestClient(TestServer(app)) as c:
        c.app_settings = settings  # type: ignore[attr-defined]
        yield c


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_healthz_is_public(client: ApiClient) -> None:
    r = await client.get("/healthz")
    assert r.status == 200
    body = await r.json()
    assert body["status"] == "ok" and body["accel"] == "tcg" and body["templates"] == ["python"]


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}, {"Authorization": "Bearer "}],
)
async def test_requests_without_a_valid_key_get_401(client: ApiClient, headers: dict[str, str]) -> None:
    r = await client.get("/v1/sandboxes", headers=headers)
    assert r.status == 401
    assert (await r.json())["error"]["code"] == "unauthorized"


async def test_jupyter_token_scheme_is_accepted(client: ApiClient) -> None:
    r = await client.get("/v1/sandboxes", headers={"Authorization": f"token {KEY}"})
    assert r.status == 200 and (await r.json()) == {"sandboxes": []}


async def test_unknown_sandbox_is_404_naming_the_id(client: ApiClient) -> None:
    for method in ("GET", "DELETE"):
        r = await client.request(method, "/v1/sandboxes/sbx_nope", headers=auth())
        assert r.status == 404
        assert "sbx_nope" in (await r.json())["error"]["message"]
    r = await client.post("/v1/sandboxes/sbx_nope/execute", json={"code": "1"}, headers=auth())
    assert r.status == 404


async def test_unknown_route_is_a_json_404(client: ApiClient) -> None:
    r = await client.get("/v1/nothing-here", headers=auth())
    assert r.status == 404 and "/v1/nothing-here" in (await r.json())["error"]["message"]


@pytest.mark.parametrize(
    "body,needle",
    [
        ({"template": "nope"}, "valid templates: python"),
        ({"template": 3}, "'template' must be str"),
        ({"idle_timeout_seconds": 0}, "idle_timeout_seconds=0"),
        ({"idle_timeout_seconds": "x"}, "'idle_timeout_seconds' must be int"),
        ({"metadata": {"a": 1}}, "metadata"),
        ([1, 2], "JSON object"),
        ({"network": "open"}, "network mode 'open'"),
        ({"network": {"mode": "allowlist", "allow": ["a b"]}}, "allow entry 'a b'"),
    ],
)
async def test_create_validation(client: ApiClient, body: object, needle: str) -> None:
    r = await client.post("/v1/sandboxes", json=body, headers=auth())
    assert r.status == 400
    assert needle in (await r.json())["error"]["message"]


async def test_failed_boot_is_503_and_leaves_nothing(client: ApiClient) -> None:
    settings = client.app_settings  # type: ignore[attr-defined]
    r = await client.post("/v1/sandboxes", json={}, headers=auth())
    assert r.status == 503
    err = (await r.json())["error"]
    assert err["code"] == "boot_failed" and "KERNELHOST_BOOT_TIMEOUT" in err["message"]
    r = await client.get("/v1/sandboxes", headers=auth())
    assert (await r.json()) == {"sandboxes": []}
    import libvirt

    conn = libvirt.open("test:///default")
    assert not [d.name() for d in conn.listAllDomains() if d.name().startswith("khunit-")]
    assert not list(Path(settings.run_dir).glob("khunit-*"))


def test_settings_errors_name_the_value_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"KERNELHOST_PORT.*'abc'"):
        Settings.load({"KERNELHOST_PORT": "abc"})
    with pytest.raises(ConfigError, match="auto, kvm or tcg"):
        Settings.load({"KERNELHOST_ACCEL": "fast"})
    with pytest.raises(ConfigError, match="at least 16"):
        Settings.load({"KERNELHOST_API_KEYS": "short"})
    cfg = tmp_path / "c.toml"
    cfg.write_text('[kernelhost]\nport = 9100\napi_keys = ["a-long-enough-key-1234"]\n')
    s = Settings.load({"KERNELHOST_CONFIG": str(cfg), "KERNELHOST_HOST": "0.0.0.0"})
    assert (s.port, s.host, s.api_keys) == (9100, "0.0.0.0", ("a-long-enough-key-1234",))
    cfg.write_text("[kernelhost]\nbogus = 1\n")
    with pytest.raises(ConfigError, match="unknown setting 'bogus'"):
        Settings.load({"KERNELHOST_CONFIG": str(cfg)})
    with pytest.raises(ConfigError, match="does not exist"):
        Settings.load({"KERNELHOST_CONFIG": str(tmp_path / "missing.toml")})


def test_dev_key_is_generated_once_and_kept(tmp_path: Path) -> None:
    from kernelhost.api.auth import KeyRing

    settings = Settings.load({}, state_dir=tmp_path)
    first = KeyRing.from_settings(settings)
    second = KeyRing.from_settings(settings)
    assert first.dev_key and first.dev_key == second.dev_key
    assert settings.dev_key_file.stat().st_mode & 0o777 == 0o600
    assert first.identify(first.dev_key) is not None and first.identify("nope") is None


@pytest.mark.parametrize(
    "limits,needle",
    [
        ({"max_sandboxes_per_key": 0}, "max_sandboxes_per_key"),
        ({"max_memory_mib_per_key": 256}, "max_memory_mib_per_key"),
    ],
)
async def test_per_key_limits_answer_429_naming_the_limit(
    tmp_path: Path, limits: dict[str, Any], needle: str
) -> None:
    settings = offline_settings(
        tmp_path, image_dir=fake_image_dir(tmp_path), snapshots="off", pool_size=0, api_keys=(KEY,), **limits
    )
    async with TestClient(TestServer(init_app(settings))) as c:
        r = await c.post("/v1/sandboxes", json={}, headers=auth())
        assert r.status == 429
        err = (await r.json())["error"]
        assert err["code"] == "capacity_exceeded" and needle in err["message"]
        assert err["limit"] == needle


async def test_a_body_that_is_not_utf8_is_a_400_not_a_500(client: ApiClient) -> None:
    for path in ("/v1/sandboxes", "/v1/sandboxes/sbx_x/execute", "/api/kernels"):
        r = await client.post(path, data=b"\xffg\x13", headers={**auth(), "Content-Type": "application/json"})
        assert r.status in (400, 404), path
        assert "error" in (await r.json()) or "message" in (await r.json())
