"""The real ``jupyter server`` (started as ``jupyter lab --gateway-url=...``) runs its kernels in
kernelhost VMs: kernelspecs, start, code over its own WebSocket, interrupt, restart and delete,
all through jupyter_server's REST and WebSocket API."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from ..harness import Service
from .jupyter_support import JupyterLab, KernelSocket, Outcome, ws_url

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


async def test_kernel_lifecycle_through_jupyter_server(
    jupyter_lab: JupyterLab, jupyter_service: Service
) -> None:
    lab, svc = jupyter_lab, jupyter_service
    mine = {"Authorization": f"token {svc.api_key}"}
    async with (
        aiohttp.ClientSession(headers=lab.headers()) as http,
        aiohttp.ClientSession(headers=mine) as service,
    ):
        async with http.get(f"{lab.url}/api/kernelspecs") as r:
            specs = await r.json()
        # jupyter_server answers its own default once, then adopts the gateway's
        async with http.get(f"{lab.url}/api/kernelspecs") as r:
            specs = await r.json()
        assert r.status == 200 and specs["default"] == "python"
        assert specs["kernelspecs"]["python"]["spec"]["language"] == "python"
        # python3, an alias of the python template, passes jupyter_server's own checks too
        assert specs["kernelspecs"]["python3"]["spec"]["metadata"]["kernelhost"]["alias_of"] == "python"

        async with http.post(f"{lab.url}/api/kernels", json={"name": "python"}) as r:
            assert r.status == 201, await r.text()
            kid = (await r.json())["id"]
        # jupyter_server's kernel is one of our sandboxes, under the same id
        async with service.get(f"{svc.url}/api/kernels/{kid}") as r:
            model = await r.json()
        assert r.status == 200 and model["name"] == "python"
        sandbox_id = model["sandbox_id"]
        async with service.get(f"{svc.url}/v1/sandboxes/{sandbox_id}") as r:
            assert r.status == 200
            assert (await r.json())["metadata"]["jupyter_gateway"] == "kernel"
        # ... that no other key can see, over REST or WebSocket
        async with aiohttp.ClientSession(headers={"Authorization": f"token {svc.other_key}"}) as other:
            async with other.get(f"{svc.url}/api/kernels/{kid}") as r:
                assert r.status == 404
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await other.ws_connect(f"{ws_url(svc.url)}/api/kernels/{kid}/channels")
            assert refused.value.status == 404

        ws = await http.ws_connect(f"{ws_url(lab.url)}/api/kernels/{kid}/channels?session_id=test-session")
        kernel = KernelSocket(ws)
        try:
            info = await kernel.outcome(await kernel.send("kernel_info_request", {}), 60)
            assert info.reply is not None
            assert info.reply["content"]["language_info"]["name"] == "python"

            out = await kernel.run("a = 6 * 7\nprint('a is', a)\na")
            assert out.reply is not None and out.reply["content"]["status"] == "ok"
            assert out.stdout == "a is 42\n"
            assert out.results == [{"text/plain": "42"}]

            # interrupt: a long sleep ends with KeyboardInterrupt, the kernel keeps its state
            sleeping = await kernel.execute_request(
                "import time\nprint('sleeping', flush=True)\ntime.sleep(600)"
            )
            progress = Outcome()
            await kernel.wait_output(sleeping, "sleeping", 60, progress)
            async with http.post(f"{lab.url}/api/kernels/{kid}/interrupt", json={}) as r:
                assert r.status == 204, await r.text()
            stopped = await kernel.outcome(sleeping, 60, into=progress)
            assert stopped.reply is not None and stopped.reply["content"]["status"] == "error"
            assert stopped.error is not None and stopped.error["ename"] == "KeyboardInterrupt"
            assert (await kernel.run("print(a)")).stdout == "42\n"

            # restart: a fresh kernel in the same VM, variables gone
            async with http.post(f"{lab.url}/api/kernels/{kid}/restart", json={}) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["id"] == kid
            fresh = await kernel.run("print('a' in dir())")
            assert fresh.stdout == "False\n"
        finally:
            await kernel.close()

        async with http.delete(f"{lab.url}/api/kernels/{kid}") as r:
            assert r.status == 204
        async with http.get(f"{lab.url}/api/kernels/{kid}") as r:
            assert r.status == 404
        async with service.get(f"{svc.url}/v1/sandboxes/{sandbox_id}") as r:
            assert r.status == 404  # the kernel's VM is gone with it


async def test_kernels_of_the_gateway_api_directly(jupyter_service: Service) -> None:
    """The service's own endpoints as a Kernel Gateway client sees them (no jupyter_server)."""
    svc = jupyter_service
    async with aiohttp.ClientSession(headers={"Authorization": f"token {svc.api_key}"}) as http:
        async with http.get(f"{svc.url}/api/kernelspecs/python") as r:
            assert r.status == 200 and (await r.json())["name"] == "python"
        async with http.get(f"{svc.url}/api/kernelspecs/nope") as r:
            assert r.status == 404 and "python" in (await r.json())["error"]["message"]
        async with http.get(f"{svc.url}/kernelspecs/python/logo-64x64.png") as r:
            assert r.status == 200 and (await r.read())[:4] == b"\x89PNG"
        async with http.post(f"{svc.url}/api/kernels", json={"name": "cobol"}) as r:
            assert r.status == 400 and "python" in (await r.json())["error"]["message"]
        # the network mode, as jupyter_server forwards it (KERNEL_* variables of its environment)
        async with http.post(
            f"{svc.url}/api/kernels",
            json={
                "name": "python",
                "env": {
                    "KERNEL_NETWORK": "allowlist",
                    "KERNEL_NETWORK_ALLOW": "files.example.org:443, *.example.net",
                },
            },
        ) as r:
            assert r.status == 201
            online = await r.json()
        async with http.get(f"{svc.url}/v1/sandboxes") as r:
            [made] = [
                s
                for s in (await r.json())["sandboxes"]
                if s["state"] == "running" and s["network"]["mode"] == "allowlist"
            ]
        assert made["network"]["allow"] == ["files.example.org:443", "*.example.net"]
        async with http.delete(f"{svc.url}/api/kernels/{online['id']}") as r:
            assert r.status == 204
        async with http.post(
            f"{svc.url}/api/kernels", json={"name": "python", "env": {"KERNEL_NETWORK": "wide-open"}}
        ) as r:
            assert r.status == 400 and "wide-open" in (await r.json())["error"]["message"]
        async with http.post(f"{svc.url}/api/kernels", json={"name": "python"}) as r:
            assert r.status == 201
            model = await r.json()
        assert r.headers["Location"] == f"/api/kernels/{model['id']}"
        # the exact format jupyter_server parses, and a UUID id
        from datetime import datetime

        datetime.strptime(model["last_activity"], "%Y-%m-%dT%H:%M:%S.%fZ")
        assert len(model["id"].split("-")) == 5 and isinstance(model["connections"], int)
        try:
            # the v1 framing: binary frames, buffers kept
            ws = await http.ws_connect(
                f"{ws_url(svc.url)}/api/kernels/{model['id']}/channels",
                protocols=("v1.kernel.websocket.jupyter.org",),
            )
            assert ws.protocol == "v1.kernel.websocket.jupyter.org"
            from kernelhost.jupyter import wire

            await ws.send_bytes(
                wire.to_v1(
                    "shell",
                    {
                        "header": {
                            "msg_id": "m1",
                            "msg_type": "execute_request",
                            "session": "s",
                            "username": "u",
                            "version": "5.3",
                            "date": "",
                        },
                        "parent_header": {},
                        "metadata": {},
                        "content": {
                            "code": "print('v1 ok')",
                            "silent": False,
                            "store_history": True,
                            "user_expressions": {},
                            "allow_stdin": False,
                        },
                    },
                )
            )
            got: list[tuple[str, dict[str, Any]]] = []
            while not any(m["header"]["msg_type"] == "execute_reply" for _, m in got):
                raw = await asyncio.wait_for(ws.receive(), 60)
                assert raw.type == aiohttp.WSMsgType.BINARY, raw
                got.append(wire.from_v1(raw.data))
            assert any(c == "iopub" and m["content"].get("text") == "v1 ok\n" for c, m in got)
            # a frame that is not a Jupyter message closes the socket, naming the fault
            await ws.send_str('{"channel": "shell", "header": {}}')
            closing = await asyncio.wait_for(ws.receive(), 30)
            while closing.type not in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED):
                closing = await asyncio.wait_for(ws.receive(), 30)
            assert ws.close_code == 1007
            await ws.close()
        finally:
            async with http.delete(f"{svc.url}/api/kernels/{model['id']}") as r:
                assert r.status == 204
