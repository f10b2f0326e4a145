"""A key's own template in the Jupyter clients: JupyterLab lists it as a kernelspec and runs a
cell on it; papermill runs a notebook on it through the provisioner
(``kernelhost kernelspec install --template``)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from nbformat import v4

from .conftest import RESULTS
from .jupyter_support import JupyterLab, run_first_cell
from .test_jupyter_lab import CHROMIUM, FLAGS, PATIENCE_MS

pytestmark = [pytest.mark.clients, pytest.mark.timeout(900)]

new_notebook: Callable[..., nbformat.NotebookNode] = v4.new_notebook
new_code_cell: Callable[..., nbformat.NotebookNode] = v4.new_code_cell
write_notebook: Callable[..., None] = nbformat.write
read_notebook: Callable[..., nbformat.NotebookNode] = nbformat.read
BIN = Path(sys.executable).parent
CELL = "import tomli_w, os\nprint('kit says', tomli_w.dumps({'a': 6 * 7}).strip(), os.getcwd())"


def _kernelspecs(lab: JupyterLab) -> dict[str, object]:
    req = urllib.request.Request(
        f"{lab.url}/api/kernelspecs", headers={"Authorization": f"token {lab.token}"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.load(r)["kernelspecs"])


async def test_jupyterlab_lists_a_custom_template_and_runs_a_cell_in_it(
    jupyter_lab: JupyterLab, jupyter_template: str
) -> None:
    from playwright.async_api import async_playwright

    specs = await asyncio.to_thread(_kernelspecs, jupyter_lab)
    assert jupyter_template in specs, list(specs)
    nb = new_notebook(cells=[new_code_cell(CELL)])
    nb.metadata["kernelspec"] = {
        "name": jupyter_template,
        "language": "python",
        "display_name": jupyter_template,
    }
    write_notebook(nb, jupyter_lab.root / "kit.ipynb")
    shot = RESULTS / "jupyterlab-template.png"
    RESULTS.mkdir(exist_ok=True)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = await browser.new_page(viewport={"width": 1280, "height": 800})
            page.set_default_timeout(PATIENCE_MS)
            await run_first_cell(
                page, jupyter_lab, "kit.ipynb", "kit says a = 42 /home/user", shot, PATIENCE_MS / 1000
            )
        finally:
            await browser.close()
            await asyncio.to_thread(jupyter_lab.shut_down_kernels)  # the template can then go


def test_papermill_runs_a_notebook_on_a_custom_template(
    jupyter_env: dict[str, str], jupyter_template: str, tmp_path: Path
) -> None:
    name = f"kernelhost-{jupyter_template}"
    prefix = Path(jupyter_env["JUPYTER_PATH"]).parent.parent
    subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", "kernelspec", "install", "--template", jupyter_template,
         "--prefix", str(prefix)],
        env=jupyter_env, check=True, timeout=60, capture_output=True,
    )  # fmt: skip
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nb = new_notebook(cells=[new_code_cell(CELL), new_code_cell("import sys; 'tomli_w' in sys.modules")])
    nb.metadata["kernelspec"] = {"name": name, "display_name": name, "language": "python"}
    write_notebook(nb, src)
    run = subprocess.run(
        [str(BIN / "papermill"), str(src), str(out), "-k", name, "--execution-timeout", "120"],
        env=jupyter_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    cells = read_notebook(out, as_version=4).cells
    assert "kit says a = 42 /home/user" in "".join(o.get("text", "") for o in cells[0].outputs)
    assert cells[1].outputs[0]["data"]["text/plain"] == "True"
