"""Helpers of the Jupyter client tests: a Jupyter client over a kernel WebSocket (legacy JSON
text framing, as jupyter_server speaks it), with every wait bounded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

if TYPE_CHECKING:
    from playwright.async_api import Page, WebSocket


@dataclass
class JupyterLab:
    """A running ``jupyter lab`` whose kernels live on the service."""

    url: str
    token: str
    root: Path
    log_path: Path

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"token {self.token}"}

    def page_url(self, notebook: str) -> str:
        """The notebook in a workspace of its own: JupyterLab restores the default workspace,
        with every notebook an earlier test opened, and its cells and kernels with it."""
        workspace = f"{Path(notebook).stem}-{os.urandom(3).hex()}"
        return f"{self.url}/lab/workspaces/{workspace}/tree/{notebook}?token={self.token}"

    def shut_down_kernels(self) -> None:
        """End every kernel the server runs (as closing the notebooks' kernels does)."""
        req = urllib.request.Request(f"{self.url}/api/kernels", headers=self.headers())
        with urllib.request.urlopen(req, timeout=60) as r:
            kernels = json.load(r)
        for kernel in kernels:
            req = urllib.request.Request(
                f"{self.url}/api/kernels/{kernel['id']}", headers=self.headers(), method="DELETE"
            )
            with contextlib.suppress(urllib.error.HTTPError), urllib.request.urlopen(req, timeout=120):
                pass


async def open_notebook(page: Page, lab: JupyterLab, notebook: str, timeout: float) -> None:
    """Open ``notebook`` in its own workspace and wait until its kernel is up: its WebSocket
    brought a kernel_info_reply (the page shows "idle" before the kernel exists, and a cell run
    then goes nowhere)."""
    kernel_ready = asyncio.Event()

    def watch(ws: WebSocket) -> None:
        if "/channels" in ws.url:
            ws.on(
                "framereceived",
                lambda payload: kernel_ready.set() if "kernel_info_reply" in str(payload) else None,
            )

    page.on("websocket", watch)
    await page.goto(lab.page_url(notebook))
    await asyncio.wait_for(kernel_ready.wait(), timeout)


async def run_cell(page: Page, index: int) -> None:
    """Run the notebook's cell ``index`` as a user does: click into it, Shift+Enter."""
    await page.locator(".jp-Cell .jp-InputArea-editor .cm-content").nth(index).click()
    await page.keyboard.press("Shift+Enter")


async def run_first_cell(
    page: Page, lab: JupyterLab, notebook: str, expect: str, shot: Path, timeout: float
) -> None:
    """Open ``notebook``, run its first cell once its kernel is up, wait for an output with
    ``expect``, and keep a screenshot of the page either way."""
    await open_notebook(page, lab, notebook, timeout)
    await run_cell(page, 0)
    try:
        await page.locator(".jp-OutputArea-output", has_text=expect).wait_for()
    finally:
        await page.screenshot(path=str(shot))


@dataclass
class Outcome:
    """What one request brought back: its reply and the iopub messages with it as parent."""

    reply: dict[str, Any] | None = None
    iopub: list[dict[str, Any]] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.iopub
            if m["header"]["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )

    @property
    def results(self) -> list[dict[str, Any]]:
        return [
            m["content"]["data"]
            for m in self.iopub
            if m["header"]["msg_type"] in ("execute_result", "display_data")
        ]

    @property
    def error(self) -> dict[str, Any] | None:
        return next((m["content"] for m in self.iopub if m["header"]["msg_type"] == "error"), None)


class KernelSocket:
    """A Jupyter client on one kernel WebSocket: send requests, sort what comes by parent."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.session = uuid.uuid4().hex
        self.by_parent: dict[str, asyncio.Queue[dict[str, Any]]] = {}
        self.seen: list[dict[str, Any]] = []  # every message, in arrival order
        self.closed = asyncio.Event()
        self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.ws:
                if raw.type != aiohttp.WSMsgType.TEXT:
                    continue
                msg = json.loads(raw.data)
                msg["_arrived"] = asyncio.get_running_loop().time()
                self.seen.append(msg)
                parent = (msg.get("parent_header") or {}).get("msg_id")
                if parent:
                    self._queue(parent).put_nowait(msg)
        finally:
            self.closed.set()

    def _queue(self, msg_id: str) -> asyncio.Queue[dict[str, Any]]:
        return self.by_parent.setdefault(msg_id, asyncio.Queue())

    async def send(self, msg_type: str, content: dict[str, Any], channel: str = "shell") -> str:
        msg_id = uuid.uuid4().hex
        self._queue(msg_id)
        await self.ws.send_str(
            json.dumps(
                {
                    "channel": channel,
                    "header": {
                        "msg_id": msg_id,
                        "msg_type": msg_type,
                        "session": self.session,
                        "username": "test",
                        "version": "5.3",
                        "date": datetime.now(UTC).isoformat(),
                    },
                    "parent_header": {},
                    "metadata": {},
                    "content": content,
                    "buffers": [],
                }
            )
        )
        return msg_id

    async def execute_request(self, code: str, allow_stdin: bool = False) -> str:
        return await self.send(
            "execute_request",
            {
                "code": code,
                "silent": False,
                "store_history": True,
                "user_expressions": {},
                "allow_stdin": allow_stdin,
                "stop_on_error": True,
            },
        )

    async def next(self, msg_id: str, timeout: float) -> dict[str, Any]:
        try:
            return await asyncio.wait_for(self._queue(msg_id).get(), timeout)
        except TimeoutError:
            now = asyncio.get_running_loop().time()
            seen = [
                (
                    m.get("channel"),
                    m["header"].get("msg_type"),
                    (m.get("parent_header") or {}).get("msg_id"),
                    f"{now - m['_arrived']:.1f}s ago",
                )
                for m in self.seen[-20:]
            ]
            raise AssertionError(
                f"nothing more for request {msg_id} within {timeout:.0f}s "
                f"(closed: {self.closed.is_set()}); last messages: {seen}"
            ) from None

    async def wait_output(self, msg_id: str, text: str, timeout: float, into: Outcome) -> None:
        """Collect into ``into`` until stdout holds ``text`` (the request is still running)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while text not in into.stdout:
            msg = await self.next(msg_id, max(0.1, deadline - loop.time()))
            self._file(msg, into)

    async def outcome(self, msg_id: str, timeout: float, into: Outcome | None = None) -> Outcome:
        """Everything of the request until its reply and its idle status (with a deadline)."""
        out = into or Outcome()
        idle = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while out.reply is None or not idle:
            msg = await self.next(msg_id, max(0.1, deadline - loop.time()))
            if self._file(msg, out):  # (not `idle or ...`: every message is filed)
                idle = True
        return out

    @staticmethod
    def _file(msg: dict[str, Any], out: Outcome) -> bool:
        """File ``msg``; True if it is the idle status."""
        if msg["channel"] == "iopub":
            out.iopub.append(msg)
            idle: bool = msg["header"]["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
            return idle
        if msg["header"]["msg_type"].endswith("_reply"):
            out.reply = msg
        return False

    async def run(self, code: str, timeout: float = 120.0) -> Outcome:
        return await self.outcome(await self.execute_request(code), timeout)

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader


def ws_url(http_url: str) -> str:
    return "ws" + http_url[len("http") :]
