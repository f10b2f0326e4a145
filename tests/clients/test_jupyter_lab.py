"""JupyterLab in headless Chromium (the distribution's package), on ``jupyter lab
--gateway-url=...``: a notebook opens on a VM-backed kernel, a cell runs, its output shows.
The screenshot is kept as results/jupyterlab.png."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import aiohttp
import nbformat
import pytest
from nbformat import v4

from ..harness import Service
from .conftest import RESULTS
from .jupyter_support import JupyterLab, run_first_cell

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


async def test_jupyterlab_runs_a_cell_in_a_vm(jupyter_lab: JupyterLab, jupyter_service: Service) -> None:
    from playwright.async_api import async_playwright

    nb = new_notebook(cells=[new_code_cell("import os\nprint('hello from', os.getcwd(), 6 * 7)")])
    nb.metadata["kernelspec"] = {
        "name": "python",
        "language": "python",
        "display_name": "Python 3 (kernelhost VM, python)",
    }
    write_notebook(nb, jupyter_lab.root / "vm.ipynb")

    RESULTS.mkdir(exist_ok=True)
    shot = RESULTS / "jupyterlab.png"
    shot.unlink(missing_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(PATIENCE_MS)
            await run_first_cell(
                page, jupyter_lab, "vm.ipynb", "hello from /home/user 42", shot, PATIENCE_MS / 1000
            )
            # the kernel that ran the cell is a sandbox on the service, JupyterLab attached
            async with (
                aiohttp.ClientSession(headers={"Authorization": f"token {jupyter_service.api_key}"}) as http,
                http.get(f"{jupyter_service.url}/api/kernels") as r,
            ):
                kernels = await r.json()
            assert any(k["connections"] >= 1 and k["name"] == "python" for k in kernels), kernels
        finally:
            await browser.close()
    assert shot.stat().st_size > 10_000
