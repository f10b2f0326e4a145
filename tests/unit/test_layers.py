"""Imports run one way (design.md): check each layer in a clean interpreter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PACKAGES = ["hypervisor", "kernelhost", "kernelhost.channel", "kernelhost.channel.codec",
            "kernelhost.sandboxes", "kernelhost.api", "kernelhost.client", "kernelhost.cli",
            "kernelhost.integrations", "kernelhost.jupyter"]


def loaded_after(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize("module", PACKAGES)
def test_every_package_imports_alone(module: str) -> None:
    loaded_after(module)  # raises on circular or missing imports


def test_hypervisor_knows_nothing_of_http_jupyter_or_the_service() -> None:
    mods = loaded_after("hypervisor")
    assert not {m for m in mods if m.split(".")[0] in ("aiohttp", "jupyter_client", "kernelhost")}


def test_codec_is_sans_io_and_standalone() -> None:
    """The guest imports codec.py as a lone file: it may need nothing but msgpack."""
    from pathlib import Path

    import kernelhost.channel.codec as codec

    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import codec; "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-I", "-c", code, str(Path(codec.__file__).parent)],
                         capture_output=True, text=True, check=True, cwd="/")
    mods = set(json.loads(out.stdout))
    assert not {m for m in mods if m.split(".")[0] in ("asyncio", "aiohttp", "kernelhost")}


def test_channel_and_sandboxes_do_not_know_http() -> None:
    for module in ("kernelhost.channel", "kernelhost.sandboxes"):
        mods = loaded_after(module)
        assert "aiohttp.web" not in mods and "kernelhost.api" not in mods, module


def test_sdk_imports_nothing_of_the_server() -> None:
    mods = loaded_after("kernelhost")
    server = {"kernelhost.api", "kernelhost.sandboxes", "kernelhost.channel", "hypervisor",
              "libvirt", "jupyter_client", "aiohttp.web"}
    assert not mods & server
