"""Gateway clients that could not connect before issue 39 (items 5 and 6), each as the client
calls the Kernel Gateway API, against the real service and a VM:

- AutoGen's Jupyter code executor (``autogen.coding.jupyter``): ``requests`` and
  ``websocket-client`` with ``Authorization: token``, the kernel name ``python3`` looked up in
  ``GET /api/kernelspecs`` first ("Kernel python3 is not installed" otherwise);
- Open WebUI's Jupyter code-execution engine (and smolagents' gateway executors): the key as
  ``?token=`` on every REST call and on the channels WebSocket (``websockets``), never in a log.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aiohttp
import pytest
import requests
import websocket
import websockets

from ..harness import Service
from .jupyter_support import ws_url

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


def _execute_request(code: str) -> tuple[str, str]:
    msg_id = uuid.uuid4().hex
    msg = {
        "header": {
            "msg_id": msg_id,
            "msg_type": "execute_request",
            "username": "client",
            "session": uuid.uuid4().hex,
            "date": datetime.now(UTC).isoformat(),
            "version": "5.0",
        },
        "parent_header": {},
        "metadata": {},
        "content": {
            "code": code,
            "silent": False,
            "store_history": True,
            "user_expressions": {},
            "allow_stdin": False,
            "stop_on_error": True,
        },
        "channel": "shell",
        "buffers": [],
    }
    return msg_id, json.dumps(msg)


def _collect(msg: dict[str, Any], out: dict[str, Any]) -> bool:
    """File one message of the request into ``out``; True once both its reply and its idle
    status came (in either order: they travel on different channels)."""
    kind, content = msg["header"]["msg_type"], msg["content"]
    if kind == "stream":
        out["stdout"] += content["text"]
    elif kind == "execute_result":
        out["result"] = content["data"]["text/plain"]
    elif kind == "execute_reply":
        out["status"] = content["status"]
    elif kind == "status" and content["execution_state"] == "idle":
        out["idle"] = True
    return bool(out["idle"] and out["status"])


def test_autogen_jupyter_executor_finds_and_starts_python3(jupyter_service: Service) -> None:
    """What ``JupyterCodeExecutor(JupyterConnectionInfo(host, port=..., token=...))`` does."""
    svc, headers = jupyter_service, {"Authorization": f"token {jupyter_service.api_key}"}
    http = requests.Session()
    specs = http.get(f"{svc.url}/api/kernelspecs", headers=headers, timeout=30).json()
    assert "python3" in specs["kernelspecs"], "Kernel python3 is not installed"
    assert specs["kernelspecs"]["python3"]["spec"]["language"] == "python"
    r = http.post(f"{svc.url}/api/kernels", headers=headers, json={"name": "python3"}, timeout=130)
    assert r.status_code == 201, r.text
    kernel_id = r.json()["id"]
    try:
        model = http.get(f"{svc.url}/api/kernels/{kernel_id}", headers=headers, timeout=30).json()
        assert model["name"] == "python3"  # the name it was started under
        sandbox = http.get(f"{svc.url}/v1/sandboxes/{model['sandbox_id']}", headers=headers, timeout=30)
        assert sandbox.json()["template"] == "python"
        ws = websocket.create_connection(
            f"{ws_url(svc.url)}/api/kernels/{kernel_id}/channels", header=headers, timeout=120
        )
        try:
            msg_id, frame = _execute_request("import sys\nprint('hello from', sys.platform)\n6 * 7")
            ws.send(frame)
            out: dict[str, Any] = {"stdout": "", "result": None, "status": None, "idle": False}
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                msg = json.loads(ws.recv())
                if msg["parent_header"].get("msg_id") == msg_id and _collect(msg, out):
                    break
        finally:
            ws.close()
        assert out == {"stdout": "hello from linux\n", "result": "42", "status": "ok", "idle": True}
    finally:
        assert (
            http.delete(f"{svc.url}/api/kernels/{kernel_id}", headers=headers, timeout=60).status_code == 204
        )


async def test_open_webui_sends_the_key_as_a_query_token(jupyter_service: Service) -> None:
    """Open WebUI's ``JupyterCodeExecuter``: aiohttp with ``params={"token": ...}`` for REST,
    ``websockets.connect(".../channels?token=...")`` for the kernel's messages."""
    svc = jupyter_service
    params = {"token": svc.api_key}
    async with aiohttp.ClientSession(base_url=svc.url) as http:
        async with http.get("/api/kernelspecs", params=params) as r:
            assert r.status == 200 and "python3" in (await r.json())["kernelspecs"]
        async with http.get("/api/kernels", params={"token": "not-the-key"}) as r:
            assert r.status == 401
        async with http.post("/api/kernels", params=params) as r:  # no body: the default kernel
            assert r.status == 201, await r.text()
            kernel_id = (await r.json())["id"]
        try:
            url = f"{ws_url(svc.url)}/api/kernels/{kernel_id}/channels?token={svc.api_key}"
            async with websockets.connect(url, open_timeout=60) as ws:
                msg_id, frame = _execute_request("x = 'query token'\nprint(x.upper())")
                await ws.send(frame)
                out: dict[str, Any] = {"stdout": "", "result": None, "status": None, "idle": False}
                while not (out["idle"] and out["status"]):
                    msg = json.loads(await asyncio.wait_for(ws.recv(), 120))
                    if msg["parent_header"].get("msg_id") == msg_id:
                        _collect(msg, out)
            assert out["stdout"] == "QUERY TOKEN\n" and out["status"] == "ok"
            with pytest.raises(websockets.InvalidStatus) as refused:
                await websockets.connect(f"{ws_url(svc.url)}/api/kernels/{kernel_id}/channels?token=nope")
            assert refused.value.response.status_code == 401
        finally:
            async with http.delete(f"/api/kernels/{kernel_id}", params=params) as r:
                assert r.status == 204
    # the key went in URLs; it is in no line of the service's log
    assert svc.api_key not in svc.log_path.read_text(errors="replace")
