"""A bounded schemathesis run against the live service's own OpenAPI document.

It uses the second API key, so every sandbox it manages to create can be counted and removed
afterwards: the run must produce no 5xx, and leave no sandbox, domain or file behind.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import aiohttp
import pytest

from ..harness import Service

pytestmark = [pytest.mark.vm, pytest.mark.timeout(600)]  # bounded by --max-examples


async def test_schemathesis_finds_no_server_error_and_nothing_leaks(service: Service, tmp_path: Path) -> None:
    st = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert st, "schemathesis is a dev dependency: pip install -e '.[dev]'"
    proc = await asyncio.create_subprocess_exec(
        st,
        "run",
        f"{service.url}/openapi.json",
        "-H",
        f"Authorization: Bearer {service.other_key}",
        "--checks",
        "not_a_server_error",
        "--max-examples",
        "3",  # ~3 min over every route; CI's budget is shared with the whole VM tier
        "--phases",
        "examples,coverage,fuzzing",
        "--seed",
        "1",
        "--generation-database",
        "none",
        "--request-timeout",
        "120",
        "--suppress-health-check",
        "all",
        # a valid spec is a real build (packages, a snapshot boot): the spec's checks have their
        # own tests (tests/unit/test_template_spec.py, test_templates_api.py)
        "--exclude-name",
        "POST /v1/templates",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 900)
    report = out.decode(errors="replace")[-8000:]
    try:
        assert proc.returncode == 0, report
    finally:
        await _delete_all(service)


async def _delete_all(service: Service) -> None:
    headers = {"Authorization": f"Bearer {service.other_key}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        r = await http.get(f"{service.url}/v1/sandboxes")
        made = (await r.json())["sandboxes"]
        for sbx in made:
            d = await http.delete(f"{service.url}/v1/sandboxes/{sbx['id']}")
            assert d.status == 204
        r = await http.get(f"{service.url}/v1/sandboxes")
        assert (await r.json())["sandboxes"] == []
