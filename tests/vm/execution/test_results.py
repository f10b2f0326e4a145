"""Rich results through a real VM: MIME bundles in order, display updates, the result cap,
the datasci template's plot and frame."""

from __future__ import annotations

import base64
import json

import aiohttp
import pytest

from kernelhost import AsyncSandbox, Result

from ...harness import Service

pytestmark = pytest.mark.vm


async def test_rich_results_stream_in_order_as_mime_bundles(py: AsyncSandbox) -> None:
    seen: list[tuple[str, object]] = []
    execution = await py.run_code(
        "from IPython.display import display, HTML, SVG, JSON, Markdown\n"
        "print('before')\n"
        "display(HTML('<table><tr><td>1</td></tr></table>'))\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>\'))\n'
        "display(JSON({'a': [1, 2]}))\n"
        "display(Markdown('**bold**'))\n"
        "print('after')\n"
        "{'value': 1}",
        on_stdout=lambda t: seen.append(("stdout", t)),
        on_result=lambda r: seen.append(("result", r.formats())),
    )
    assert execution.error is None
    # ipykernel may split one print into several stream messages under load ("after", "\n"):
    # the order is what counts, so consecutive stdout chunks count as one
    kinds = [
        kind
        for i, (kind, _) in enumerate(seen)
        if not (kind == "stdout" and i > 0 and seen[i - 1][0] == "stdout")
    ]
    assert kinds == ["stdout", "result", "result", "result", "result", "stdout", "result"]
    assert execution.stdout == "before\nafter\n"
    html, svg, js, md, value = execution.results
    assert html.html is not None, html
    assert "<table>" in html.html and "text/plain" in html.formats()
    assert svg.svg is not None and svg.svg.startswith("<svg")
    assert js.json == {"a": [1, 2]}
    assert md.markdown == "**bold**"
    assert value.is_main_result and value.text == "{'value': 1}"
    assert [r.is_main_result for r in execution.results] == [False] * 4 + [True]


async def test_a_display_updated_in_a_loop_is_one_result_and_its_updates(
    py: AsyncSandbox, execution_service: Service
) -> None:
    service = execution_service
    code = (
        "from IPython.display import display\n"
        "handle = display('step 0', display_id=True)\n"
        "for i in range(1, 21):\n"
        "    handle.update(f'step {i}')\n"
        "display('another')"
    )
    seen: list[Result] = []
    execution = await py.run_code(code, on_result=seen.append)
    assert execution.error is None
    assert [(r.is_update, r.text) for r in seen[:2]] == [(False, "'step 0'"), (True, "'step 1'")]
    assert [r.is_update for r in seen] == [False] + [True] * 20 + [False]
    assert len({r.display_id for r in seen[:21]}) == 1 and seen[0].display_id
    assert [r.text for r in execution.results] == ["'step 20'", "'another'"]
    # the wire: one result with the id, then update_display events carrying it
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {service.api_key}"}) as http:
        r = await http.post(f"{service.url}/v1/sandboxes/{py.id}/execute", json={"code": code})
        events = [json.loads(line) for line in (await r.text()).splitlines()]
    kinds = [e["type"] for e in events]
    assert kinds == ["result"] + ["update_display"] * 20 + ["result", "end"]
    assert {e["display_id"] for e in events[:21]} == {events[0]["display_id"]}
    assert "display_id" not in events[21]  # a plain display has none


async def test_result_over_the_cap_keeps_its_text_with_a_marker(py: AsyncSandbox) -> None:
    execution = await py.run_code("from IPython.display import HTML\nHTML('<p>' + 'x' * 5_000_000 + '</p>')")
    [result] = execution.results
    assert result.html is None
    assert "max_result_bytes" in (result.text or "") and "text/html" in (result.text or "")
    assert execution.status == "ok"


async def test_datasci_plot_is_a_png_and_dataframe_is_html(ds: AsyncSandbox) -> None:
    plot = await ds.run_code(
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('no show() needed')", timeout=180
    )
    assert plot.error is None, plot.error
    pngs = [r.png for r in plot.results if r.png]
    assert len(pngs) == 1
    raw = base64.b64decode(pngs[0])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 1000
    frame = await ds.run_code(
        "import numpy as np, pandas as pd, scipy.linalg\n"
        "pd.DataFrame({'x': np.arange(3), 'det': [scipy.linalg.det(np.eye(2))] * 3})",
        timeout=180,
    )
    assert frame.error is None, frame.error
    [table] = frame.results
    assert table.is_main_result and table.html is not None and "<table" in table.html and "det" in table.html
    tooling = await ds.run_code("import shutil\n[shutil.which(c) for c in ('gcc', 'g++', 'cc')]", timeout=60)
    assert tooling.text == "[None, None, None]"  # scipy came without a compiler toolchain
