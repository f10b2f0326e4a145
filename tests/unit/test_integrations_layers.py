"""The adapters sit on the SDK only (design.md): check what each loads in a clean interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SERVER = {
    "kernelhost.api",
    "kernelhost.sandboxes",
    "kernelhost.channel",
    "hypervisor",
    "libvirt",
    "jupyter_client",
    "aiohttp.web",
}


def loaded_after(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "module",
    [
        "kernelhost.integrations.anthropic",
        "kernelhost.integrations.openai_agents",
        "kernelhost.integrations.mcp_server",
        "kernelhost.integrations.output",
    ],
)
def test_adapters_import_nothing_of_the_server(module: str) -> None:
    assert not loaded_after(module) & SERVER


def test_the_anthropic_adapter_needs_no_anthropic_package() -> None:
    mods = loaded_after("kernelhost.integrations.anthropic")
    assert not {m for m in mods if m.split(".")[0] in ("anthropic", "agents", "mcp")}


def test_the_api_loads_mcp_only_when_the_app_is_built() -> None:
    assert not {m for m in loaded_after("kernelhost.api") if m.split(".")[0] == "mcp"}
