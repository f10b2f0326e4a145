"""Co-attach: a sandbox made through the SDK opened as a kernel, directly and through
jupyter_server; every attached client sees the outputs of every execution."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kernelhost import AsyncSandbox

from ..harness import Service
from .jupyter_support import JupyterLab, KernelSocket, Outcome, ws_url

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


async def _until(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout}s")
        await asyncio.sleep(0.05)


async def test_sdk_execution_shows_on_attached_websockets(
    jupyter_service: Service, jupyter_lab: JupyterLab
) -> None:
    svc = jupyter_service
    sbx = await AsyncSandbox.create(template="python", url=svc.url, api_key=svc.api_key)
    mine = {"Authorization": f"token {svc.api_key}"}
    try:
        async with (
            aiohttp.ClientSession(headers=mine) as http,
            aiohttp.ClientSession(headers=jupyter_lab.headers()) as lab,
        ):
            # the SDK's sandbox is a kernel of its owner's, and of nobody else's
            async with http.get(f"{svc.url}/api/kernels") as r:
                kid = next(k["id"] for k in await r.json() if k["sandbox_id"] == sbx.id)
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"token {svc.other_key}"}) as other,
                other.get(f"{svc.url}/api/kernels") as r,
            ):
                assert all(k["sandbox_id"] != sbx.id for k in await r.json())

            # a watcher straight on the service (by sandbox id) and one through jupyter_server
            # (POST /api/kernels with kernel_id adopts the running kernel, as JupyterLab's
            # "use kernel from other session" then shows it)
            direct = KernelSocket(await http.ws_connect(f"{ws_url(svc.url)}/api/kernels/{sbx.id}/channels"))
            async with lab.post(
                f"{jupyter_lab.url}/api/kernels", json={"name": "python", "kernel_id": kid}
            ) as r:
                assert r.status == 201, await r.text()
                assert (await r.json())["id"] == kid
            watched = KernelSocket(
                await lab.ws_connect(
                    f"{ws_url(jupyter_lab.url)}/api/kernels/{kid}/channels?session_id=watcher"
                )
            )
            try:
                # both connections are live before the agent starts
                for kernel in (direct, watched):
                    assert (
                        await kernel.outcome(await kernel.send("kernel_info_request", {}), 60)
                    ).reply is not None

                execution = await sbx.run_code("print('from the agent')\n40 + 2")
                assert execution.stdout == "from the agent\n"
                for kernel in (direct, watched):
                    await _until(
                        lambda k=kernel: any(
                            m["header"]["msg_type"] == "execute_result"
                            and m["content"]["data"].get("text/plain") == "42"
                            for m in k.seen
                        ),
                        30,
                        "the agent's result on a watcher",
                    )
                    assert "from the agent\n" in "".join(
                        m["content"]["text"] for m in kernel.seen if m["header"]["msg_type"] == "stream"
                    )
                    inputs = [
                        m["content"]["code"]
                        for m in kernel.seen
                        if m["header"]["msg_type"] == "execute_input"
                    ]
                    assert "print('from the agent')\n40 + 2" in inputs

                # a watcher's cell and the agent's call take turns: the agent's call waits for
                # the cell that runs, and each sees only its own output
                cell = await direct.execute_request(
                    "import time\nprint('cell starts', flush=True)\ntime.sleep(2)\nprint('cell ends')"
                )
                progress = Outcome()
                await direct.wait_output(cell, "cell starts", 60, progress)
                agent = asyncio.ensure_future(sbx.run_code("print('agent runs')"))
                done = await direct.outcome(cell, 60, into=progress)
                assert done.stdout == "cell starts\ncell ends\n"
                assert (await asyncio.wait_for(agent, 60)).stdout == "agent runs\n"
                await _until(
                    lambda: (
                        "agent runs\n"
                        in [m["content"]["text"] for m in watched.seen if m["header"]["msg_type"] == "stream"]
                    ),
                    30,
                    "the agent's output",
                )
                order = [m["content"]["text"] for m in watched.seen if m["header"]["msg_type"] == "stream"]
                assert order.index("cell ends\n") < order.index("agent runs\n")
                # the cell's variables are the agent's: one kernel
                assert (await sbx.run_code("print(time.time() > 0)")).stdout == "True\n"

                # shutting the kernel down from Jupyter detaches; the agent's sandbox lives on
                async with lab.delete(f"{jupyter_lab.url}/api/kernels/{kid}") as r:
                    assert r.status == 204
                await asyncio.wait_for(direct.closed.wait(), 30)
                assert direct.ws.close_code == 1000
                assert (await sbx.run_code("print('still here')")).stdout == "still here\n"
            finally:
                await direct.close()
                await watched.close()
    finally:
        await sbx.close()
