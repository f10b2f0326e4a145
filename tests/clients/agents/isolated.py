"""Frameworks whose pins conflict with the project's virtualenv run in a virtualenv of their own.

LangChain's MCP adapters need ``mcp<2`` (the service serves ``/mcp`` with ``mcp`` 2); AutoGen's
``autogen-core`` needs ``protobuf~=5.29`` (the project's is 7.x). Each such framework gets a
virtualenv built from its pinned requirements (below: what the tests declare, like
``setup.cfg``'s ``dev`` extra) by ``suite_support.suite_venv``, cached by their hash outside the
repository (``~/.cache/kernelhost/suites``). A driver script of this directory, run with that
virtualenv's Python, drives the framework against the service and prints one JSON line for the
test to check.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from ...harness import Service
from ..suite_support import suite_venv

HERE = Path(__file__).resolve().parent

#: the LangChain MCP adapters and the MCP client version they accept
LANGCHAIN_MCP = ["langchain-mcp-adapters==0.3.2", "langchain-core>=1.3.3,<2", "mcp>=1.24,<2"]
#: AutoGen's agents, its Jupyter-server executor and its scripted test model
AUTOGEN = ["autogen-agentchat==0.7.5", "autogen-ext[docker-jupyter-executor]==0.7.5"]


def framework_python(name: str, requirements: list[str]) -> Path:
    """The Python of a virtualenv that has ``requirements`` installed (built now if missing:
    30 to 40 s from the package index)."""
    return suite_venv(f"framework-{name}", requirements)


def run_driver(python: Path, script: str, service: Service, timeout: float = 300) -> dict[str, Any]:
    """Run ``script`` (a file of this directory) with ``python`` against ``service``; the JSON
    object of its last line of output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KERNELHOST_", "PYTHON"))}
    env |= {"KERNELHOST_URL": service.url, "KERNELHOST_API_KEY": service.api_key}
    done = subprocess.run(
        [str(python), str(HERE / script)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, f"{script} failed:\n{done.stderr[-4000:]}"
    lines = done.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing:\n{done.stderr[-4000:]}"
    seen = json.loads(lines[-1])
    assert isinstance(seen, dict)
    return seen
