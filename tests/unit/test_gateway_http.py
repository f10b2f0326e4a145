"""The Kernel Gateway's HTTP surface without a VM (issue 39, items 5 and 6): ``python3`` in the
kernelspec list as jupyter_server answers it, and the key as ``?token=`` on the gateway routes
only, kept out of forwarded URLs and of log lines."""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kernelhost import logs
from kernelhost.api import init_app
from kernelhost.api.credentials import without_token
from kernelhost.api.gateway.kernels import _start_options
from kernelhost.api.gateway.kernelspecs import kernelspecs, template_of
from kernelhost.sandboxes import TemplateView

from .offline import fake_image_dir, offline_settings

pytestmark = pytest.mark.unit
ApiClient = TestClient[web.Request, web.Application]
KEY = "gateway-unit-key-0123456789"


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[ApiClient]:
    settings = offline_settings(tmp_path, image_dir=fake_image_dir(tmp_path), pool_size=0, api_keys=(KEY,))
    async with TestClient(TestServer(init_app(settings))) as c:
        yield c


# -- item 5: python3 ----------------------------------------------------------------------------


async def test_kernelspecs_list_python3_as_an_alias_of_the_python_template(client: ApiClient) -> None:
    r = await client.get("/api/kernelspecs", headers={"Authorization": f"token {KEY}"})
    assert r.status == 200
    specs = await r.json()
    assert specs["default"] == "python" and set(specs["kernelspecs"]) == {"python", "python3"}
    alias = specs["kernelspecs"]["python3"]
    # the model jupyter_server's GatewayKernelSpecManager and JupyterLab validate
    assert alias["name"] == "python3"
    assert alias["spec"]["language"] == "python" and isinstance(alias["spec"]["argv"], list)
    assert alias["spec"]["display_name"] == "Python 3 (kernelhost VM, python)"
    assert alias["spec"]["metadata"]["kernelhost"] == {
        "template": "python",
        "kind": "builtin",
        "alias_of": "python",
    }
    assert all(url.startswith("/kernelspecs/python3/") for url in alias["resources"].values())
    r = await client.get("/api/kernelspecs/python3", headers={"Authorization": f"token {KEY}"})
    assert r.status == 200 and (await r.json()) == alias
    if alias["resources"]:
        r = await client.get(alias["resources"]["logo-64x64"], headers={"Authorization": f"token {KEY}"})
        assert r.status == 200 and (await r.read())[:4] == b"\x89PNG"


def _view(name: str, language: str = "python") -> TemplateView:
    return TemplateView(name=name, kind="custom", state="ready", language=language)


def test_the_alias_names_a_python_template_and_yields_to_a_template_of_that_name() -> None:
    r_only = {"r": _view("r", "R")}
    assert set(kernelspecs(r_only)) == {"r"}  # no Python template: no python3
    mixed = {"r": _view("r", "R"), "datasci": _view("datasci")}
    assert kernelspecs(mixed)["python3"].name == "datasci" and template_of("python3", mixed) == "datasci"
    own = {"python": _view("python"), "python3": _view("python3")}
    assert kernelspecs(own)["python3"].name == "python3" and template_of("python3", own) == "python3"


def test_starting_python3_starts_the_python_template_under_its_name() -> None:
    ready = {"python": _view("python"), "python-datasci": _view("python-datasci")}
    options = _start_options({"name": "python3"}, ready)
    assert options["template"] == "python"
    assert options["metadata"] == {"jupyter_gateway": "kernel", "jupyter_kernelspec": "python3"}
    assert _start_options({"name": "python"}, ready)["metadata"] == {"jupyter_gateway": "kernel"}
    assert _start_options({}, ready)["template"] == "python"


# -- item 6: ?token= ----------------------------------------------------------------------------


async def test_the_gateway_routes_take_the_key_as_a_query_token(client: ApiClient) -> None:
    r = await client.get(f"/api/kernelspecs?token={KEY}")
    assert r.status == 200 and "python3" in (await r.json())["kernelspecs"]
    r = await client.get(f"/api/kernels?token={KEY}")
    assert r.status == 200 and await r.json() == []
    r = await client.get("/api/kernels?token=wrong")
    assert r.status == 401
    r = await client.get("/api/kernels")
    assert r.status == 401 and "?token=" in (await r.json())["error"]["message"]
    # the header wins over the query, as in jupyter_server
    r = await client.get("/api/kernels?token=wrong", headers={"Authorization": f"token {KEY}"})
    assert r.status == 200
    # and the native API takes the header only
    r = await client.get(f"/v1/sandboxes?token={KEY}")
    assert r.status == 401 and "?token=" not in (await r.json())["error"]["message"]


async def test_the_channels_websocket_takes_a_query_token(client: ApiClient) -> None:
    url = "/api/kernels/00000000-0000-0000-0000-000000000000/channels"
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect(url)
    assert refused.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as unknown:
        await client.ws_connect(f"{url}?session_id=s1&token={KEY}")
    assert unknown.value.status == 404  # past the key check: no such kernel


def test_a_forwarded_call_carries_no_query_token() -> None:
    from aiohttp.test_utils import make_mocked_request

    from kernelhost.api.cluster import forward

    request = make_mocked_request("GET", "/api/kernels/k/channels?token=kh_x&session_id=s%201")
    assert str(forward._url("http://node-b:8999", request)) == (
        "http://node-b:8999/api/kernels/k/channels?session_id=s+1"
    )
    assert (
        without_token("/api/kernels/k/channels?session_id=s1&token=kh_x")
        == "/api/kernels/k/channels?session_id=s1"
    )
    assert without_token("/api/kernelspecs?token=kh_x") == "/api/kernelspecs"
    assert without_token("/api/kernels?a=%2F") == "/api/kernels?a=%2F"  # untouched without a token
    assert without_token("/v1/sandboxes/s/files?path=token%3D1") == "/v1/sandboxes/s/files?path=token%3D1"


def test_log_lines_never_show_a_token() -> None:
    assert logs.redact("GET /api/kernels?session_id=s&token=kh_secret x") == (
        "GET /api/kernels?session_id=s&token=[redacted] x"
    )
    assert logs.redact("ws://h/api/kernels/k/channels?TOKEN=kh_secret") == (
        "ws://h/api/kernels/k/channels?TOKEN=[redacted]"
    )
    # structlog's lines, through the processors the service configures
    out = io.StringIO()
    logs.configure(fmt="json")
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=out))
    try:
        structlog.get_logger("t").warning("request.failed", path="/api/kernels?token=kh_secret")
        assert "kh_secret" not in out.getvalue() and json.loads(out.getvalue())["path"].endswith("[redacted]")
    finally:
        structlog.reset_defaults()
    # the standard library's (aiohttp's own), tracebacks included
    formatter = logs.RedactingFormatter("%(name)s: %(message)s")
    try:
        raise ValueError("bad URL /api/kernels?token=kh_secret")
    except ValueError:
        record = logging.LogRecord(
            "aiohttp.server",
            logging.ERROR,
            __file__,
            1,
            "Error on %s",
            ("/?token=kh_secret",),
            sys.exc_info(),
        )
    line = formatter.format(record)
    assert "kh_secret" not in line and "token=[redacted]" in line
