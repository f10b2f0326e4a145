"""JupyterLab in headless Chromium (the distribution's package), on ``jupyter lab
--gateway-url=...``, each kernel a VM on the service:

- a notebook opens, a cell runs, its output shows (results/jupyterlab.png);
- the debugger panel: switched on, a breakpoint set in a cell's gutter, the cell stops there,
  the Variables panel lists the locals' values, a step shows the next line's, continue lets the
  cell finish
  (results/jupyterlab-debugger.png);
- an ipywidgets slider (python-datasci) round-trips both ways: moved in the page, the kernel
  reads the new value; set in the kernel, the slider moves (results/jupyterlab-widgets.png)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import nbformat
import pytest
from nbformat import v4

from ..harness import Service
from .conftest import RESULTS
from .jupyter_support import JupyterLab, open_notebook, run_cell, run_first_cell

if TYPE_CHECKING:
    from playwright.async_api import Page

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

# nbformat's functions are unannotated (untyped calls to strict mypy): typed here as used
new_notebook: Callable[..., nbformat.NotebookNode] = v4.new_notebook
new_code_cell: Callable[..., nbformat.NotebookNode] = v4.new_code_cell
write_notebook: Callable[..., None] = nbformat.write

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# as root, without a GPU, and without the background traffic this machine's closed network refuses
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PATIENCE_MS = 180_000  # JupyterLab's first load on a busy 2-core machine, and a VM under TCG


@contextlib.asynccontextmanager
async def chromium_page() -> AsyncIterator[Page]:
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(PATIENCE_MS)
            yield page
        finally:
            await browser.close()


def _notebook(lab: JupyterLab, name: str, kernel: str, cells: list[str]) -> str:
    nb = new_notebook(cells=[new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {
        "name": kernel,
        "language": "python",
        "display_name": f"Python 3 (kernelhost VM, {kernel})",
    }
    write_notebook(nb, lab.root / name)
    return name


def _shot(name: str) -> Path:
    """Where the test's screenshot goes (results/), with none of an earlier run's left."""
    RESULTS.mkdir(exist_ok=True)
    shot = RESULTS / name
    shot.unlink(missing_ok=True)
    return shot


async def test_jupyterlab_runs_a_cell_in_a_vm(jupyter_lab: JupyterLab, jupyter_service: Service) -> None:
    notebook = _notebook(
        jupyter_lab, "vm.ipynb", "python", ["import os\nprint('hello from', os.getcwd(), 6 * 7)"]
    )
    shot = _shot("jupyterlab.png")
    async with chromium_page() as page:
        await run_first_cell(
            page,
            jupyter_lab,
            notebook,
            "hello from /home/user 42",
            shot,
            PATIENCE_MS / 1000,
        )
        # the kernel that ran the cell is a sandbox on the service, JupyterLab attached
        async with (
            aiohttp.ClientSession(headers={"Authorization": f"token {jupyter_service.api_key}"}) as http,
            http.get(f"{jupyter_service.url}/api/kernels") as r,
        ):
            kernels = await r.json()
        assert any(k["connections"] >= 1 and k["name"] == "python" for k in kernels), kernels
    assert shot.stat().st_size > 10_000


DEBUG_CELL = (
    "def add(a, b):\n    total = a + b\n    return total\n\nresult = add(2, 3)\nprint('result', result)"
)


async def test_jupyterlab_debugger_stops_at_a_breakpoint_in_a_vm(jupyter_lab: JupyterLab) -> None:
    notebook = _notebook(jupyter_lab, "debug.ipynb", "python", [DEBUG_CELL])
    shot = _shot("jupyterlab-debugger.png")
    async with chromium_page() as page:
        await open_notebook(page, jupyter_lab, notebook, PATIENCE_MS / 1000)
        try:
            # the bug button is enabled once the kernel's kernel_info says it has a debugger
            bug = page.locator("jp-button.jp-DebuggerBugButton:not([disabled])")
            await bug.click()
            await page.locator('.jp-DebuggerBugButton[aria-pressed="true"]').wait_for()
            # a breakpoint on line 2 (the gutter's first element is a spacer), then run the cell
            gutter = page.locator(".jp-Cell").first.locator(
                ".cm-gutter.cm-breakpoint-gutter .cm-gutterElement"
            )
            await gutter.nth(2).click()
            await page.locator(".jp-DebuggerBreakpoint").first.wait_for()
            await run_cell(page, 0)
            # stopped in add(): the call stack shows the frame, the Variables panel its locals
            await page.locator(".jp-DebuggerCallstackFrame-name", has_text="add").wait_for()
            variables = page.locator(".jp-DebuggerVariables-body")
            for name, value in (("a", "2"), ("b", "3")):
                label = variables.locator(".jp-DebuggerVariables-name", has_text=re.compile(rf"^\s*{name}\b"))
                row = label.first.locator("xpath=..")
                await row.locator(".jp-DebuggerVariables-detail", has_text=value).wait_for()
            await page.screenshot(path=str(shot))
            # a step (Next) runs line 2: the Variables panel shows the new local
            await page.locator('jp-button[title^="Next"]').first.click()
            label = variables.locator(".jp-DebuggerVariables-name", has_text=re.compile(r"^\s*total\b"))
            await (
                label.first.locator("xpath=..")
                .locator(".jp-DebuggerVariables-detail", has_text="5")
                .wait_for()
            )
            # continue: the cell runs to its end
            await page.locator('jp-button[title^="Continue"]').first.click()
            await page.locator(".jp-OutputArea-output", has_text="result 5").wait_for()
        finally:
            if not shot.exists():
                await page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000


async def _until(predicate: Callable[[], bool], timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, f"not within {timeout}s"
        await asyncio.sleep(0.05)


WIDGET_CELLS = [
    "import ipywidgets as widgets\n"
    "slider = widgets.IntSlider(value=3, min=0, max=100, description='n')\n"
    "slider",
    "print('kernel sees', slider.value)",
    "slider.value = 42",
]


async def test_jupyterlab_widget_slider_round_trips_with_a_vm_kernel(jupyter_lab: JupyterLab) -> None:
    notebook = _notebook(jupyter_lab, "widgets.ipynb", "python-datasci", WIDGET_CELLS)
    shot = _shot("jupyterlab-widgets.png")
    async with chromium_page() as page:
        sent: list[str] = []  # what the page sent the kernel, to know when the value went out
        page.on("websocket", lambda ws: ws.on("framesent", lambda payload: sent.append(str(payload))))
        await open_notebook(page, jupyter_lab, notebook, PATIENCE_MS / 1000)
        try:
            await run_cell(page, 0)
            readout = page.locator(".widget-slider .widget-readout").first
            await page.locator(".widget-slider .widget-readout", has_text="3").wait_for()
            # the page moves the slider (its handle, by keyboard): the kernel reads the new value
            handle = page.locator(".widget-slider .noUi-handle").first
            await handle.focus()
            for _ in range(5):
                await handle.press("ArrowRight")
            await page.locator(".widget-slider .widget-readout", has_text="8").wait_for()
            # the widget manager sends a change only once the kernel is idle after the previous
            # one (its throttle): run the cell once the last went out, or it overtakes it
            await _until(lambda: any('"value":8' in frame for frame in sent), PATIENCE_MS / 1000)
            await run_cell(page, 1)
            await page.locator(".jp-OutputArea-output", has_text="kernel sees 8").wait_for()
            # the kernel sets the value: the slider in the page moves
            await run_cell(page, 2)
            await page.locator(".widget-slider .widget-readout", has_text="42").wait_for()
            assert (await readout.inner_text()).strip() == "42"
            assert await handle.get_attribute("aria-valuenow") in ("42", "42.0")
        finally:
            await page.screenshot(path=str(shot))
    assert shot.stat().st_size > 10_000
