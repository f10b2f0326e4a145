"""jupyter-kernel-gateway as a benchmark subject: started as a subprocess on a free port with
local kernels, driven over its REST API and the kernels' WebSocket channels with aiohttp.

The gateway runs in its own session (process group); ``stop`` terminates it (it shuts its
kernels down) and then kills whatever of its process tree is left, so nothing outlives the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
from common import Answer, Kernel, descendants

from tests.harness import _free_port


class Gateway:
    def __init__(self, log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = secrets.token_hex(16)
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.http: aiohttp.ClientSession | None = None
        self.version = importlib.metadata.version("jupyter-kernel-gateway")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def _spawn(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kernel_gateway",
                    "--KernelGatewayApp.ip=127.0.0.1",
                    f"--KernelGatewayApp.port={self.port}",
                    "--KernelGatewayApp.port_retries=0",
                    f"--KernelGatewayApp.auth_token={self.token}",
                    "--KernelGatewayApp.default_kernel_name=python3",
                    # jupyter_server drops stream output over 1 MB/s by default: off, so the
                    # throughput figure counts every byte, as for the other systems
                    "--ZMQChannelsWebsocketConnection.limit_rate=False",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env={**os.environ, "JUPYTER_PLATFORM_DIRS": "1"},
            )

    async def start(self, timeout: float = 60.0) -> None:
        self.proc = await asyncio.to_thread(self._spawn)
        self.http = aiohttp.ClientSession(headers=self.headers)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kernel gateway exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(aiohttp.ClientError):
                async with self.http.get(f"{self.url}/api") as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"kernel gateway did not answer within {timeout}s")
            await asyncio.sleep(0.1)

    async def start_kernel(self) -> GatewayKernel:
        assert self.http is not None
        async with self.http.post(f"{self.url}/api/kernels", json={"name": "python3"}) as r:
            if r.status != 201:
                raise RuntimeError(f"POST /api/kernels: {r.status} {await r.text()}")
            kid = (await r.json())["id"]
        k = GatewayKernel(self, kid)
        try:
            k.ws = await self.http.ws_connect(f"{self.url}/api/kernels/{kid}/channels", max_msg_size=0)
        except BaseException:
            await k.close()
            raise
        return k

    def kernel_pids(self) -> list[int]:
        return descendants(self.proc.pid) if self.proc is not None else []

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.proc is None or self.proc.poll() is not None:
            return
        tree = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)  # the gateway shuts its kernels down
        try:
            await asyncio.to_thread(self.proc.wait, 15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            await asyncio.to_thread(self.proc.wait, 10)
        for pid in tree:  # only processes this gateway started
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


class GatewayKernel(Kernel):
    name = "gateway"

    def __init__(self, gw: Gateway, kernel_id: str) -> None:
        self.gw = gw
        self.id = kernel_id
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.session = uuid.uuid4().hex

    async def execute(self, code: str, timeout: float = 600) -> Answer:
        assert self.ws is not None
        msg_id = uuid.uuid4().hex
        await self.ws.send_str(
            json.dumps(
                {
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": "execute_request",
                        "session": self.session,
                        "username": "bench",
                        "version": "5.3",
                        "date": datetime.now(UTC).isoformat(),
                    },
                    "parent_header": {},
                    "metadata": {},
                    "channel": "shell",
                    "buffers": [],
                    "content": {
                        "code": code,
                        "silent": False,
                        "store_history": True,
                        "user_expressions": {},
                        "allow_stdin": False,
                        "stop_on_error": True,
                    },
                }
            )
        )
        chars, text, status = 0, None, None
        idle = False
        deadline = time.monotonic() + timeout
        while status is None or not idle:
            m = await self.ws.receive(timeout=max(0.0, deadline - time.monotonic()))
            if m.type != aiohttp.WSMsgType.TEXT:
                raise RuntimeError(f"kernel gateway websocket: {m.type} {m.data!r:.200}")
            msg = json.loads(m.data)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            t = msg["header"]["msg_type"]
            if t == "stream":
                chars += len(msg["content"]["text"])
            elif t == "execute_result":
                text = msg["content"]["data"].get("text/plain")
            elif t == "execute_reply":
                status = msg["content"]["status"]
            elif t == "status" and msg["content"]["execution_state"] == "idle":
                idle = True
        return Answer(status, text, chars)

    async def close(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.gw.http is not None and not self.gw.http.closed:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.gw.http.delete(f"{self.gw.url}/api/kernels/{self.id}") as r:
                    await r.read()
