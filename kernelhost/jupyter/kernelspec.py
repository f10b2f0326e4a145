"""The kernelspec that ``kernelhost kernelspec install`` writes: a Python kernel run by
``KernelhostProvisioner`` in a sandbox of one template."""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from .provisioner import PROVISIONER_NAME

LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")


def kernel_json(template: str, display_name: str | None = None, url: str | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"template": template}
    if url:
        config["url"] = url
    return {
        # what the provisioner starts locally: the bridge to the sandbox's kernel
        "argv": [sys.executable, "-m", "kernelhost.jupyter.bridge"],
        "display_name": display_name or f"Python 3 (kernelhost VM, {template})",
        "language": "python",
        "interrupt_mode": "signal",  # the provisioner interrupts over HTTP
        "env": {},
        "metadata": {
            "kernel_provisioner": {"provisioner_name": PROVISIONER_NAME, "config": config},
            "debugger": True,  # ipykernel's, in the guest: the bridge relays control and iopub
        },
    }


def install(
    name: str,
    template: str = "python",
    display_name: str | None = None,
    url: str | None = None,
    user: bool = False,
    prefix: str | None = None,
) -> str:
    """Install the kernelspec ``name``; returns the directory it went to.

    ``prefix=None, user=False`` installs system-wide (like ``jupyter kernelspec install``);
    ``user=True`` under the user's Jupyter data directory; ``prefix`` under ``PREFIX/share/jupyter``.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / name
        src.mkdir()
        (src / "kernel.json").write_text(
            json.dumps(kernel_json(template, display_name, url), indent=1) + "\n"
        )
        spec = find_spec("ipykernel")
        if spec is not None and spec.submodule_search_locations:
            resources = Path(next(iter(spec.submodule_search_locations))) / "resources"
            for logo in LOGOS:
                if (resources / logo).is_file():
                    shutil.copy(resources / logo, src / logo)
        return str(
            KernelSpecManager().install_kernel_spec(str(src), kernel_name=name, user=user, prefix=prefix)
        )
