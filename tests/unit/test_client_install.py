"""The client installs alone (issue 39 item 9): ``pip install kernelhost`` gets the SDK, the
adapters, ``kernelhost mcp`` and the Jupyter provisioner with pure-Python or wheel-only packages;
the service's (libvirt-python builds from source against libvirt's headers) come with the
``server`` extra.

Each client entry point is imported in a fresh interpreter whose import system refuses every
package of the extras it does not need (a ``sys.meta_path`` finder that raises), and must load.
The packages refused are read from setup.cfg, so a new server dependency is refused here at once.
tests/clients/agents/test_packaging.py installs the built wheel itself into a fresh virtualenv.
"""

from __future__ import annotations

import ast
import configparser
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernelhost.cli.extras import EXTRA_OF_MODULE

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

#: what ``pip install kernelhost`` may pull: each has wheels for every platform we name, or is pure
CLIENT_REQUIREMENTS = {"aiohttp"}

#: a distribution whose top-level module is not its name, lowercased with ``-`` as ``_``
MODULE_OF = {
    "libvirt-python": "libvirt",
    "pyzmq": "zmq",
    "openai-agents": "agents",
    "opentelemetry-api": "opentelemetry",
    "opentelemetry-sdk": "opentelemetry",
    "opentelemetry-exporter-otlp-proto-http": "opentelemetry",
}

#: each client entry point, and the extras it may use (beside the base install)
ENTRY_POINTS = {
    "kernelhost": (),  # from kernelhost import Sandbox, AsyncSandbox
    "kernelhost.client": (),
    "kernelhost.cli": (),  # the `kernelhost` command (its client side)
    "kernelhost.integrations.anthropic": (),
    "kernelhost.integrations.openai_agents": ("openai-agents", "mcp"),  # the Agents SDK needs mcp
    "kernelhost.integrations.output": (),
    "kernelhost.integrations.mcp_server": ("mcp",),  # `kernelhost mcp`, MCP over stdio
    "kernelhost.jupyter.provisioner": ("jupyter",),
    "kernelhost.jupyter.bridge": ("jupyter",),
    "kernelhost.jupyter.kernelspec": ("jupyter",),
}

#: a fresh interpreter whose imports of the packages in argv[1] fail; imports argv[2], or runs
#: the `kernelhost` command with the arguments after it
REFUSING = """
import importlib, importlib.abc, json, sys
refused = set(json.loads(sys.argv[1]))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in refused:
            raise ModuleNotFoundError(f"No module named {name!r} (refused by the test)", name=name)
        return None

sys.meta_path.insert(0, Refuse())
if sys.argv[2] == "kernelhost":
    from kernelhost import AsyncSandbox, Sandbox  # the README's first line
if sys.argv[2] == "--command":
    from kernelhost.cli import main
    sys.exit(main(sys.argv[3:]))
importlib.import_module(sys.argv[2])
print(json.dumps(sorted({m.partition(".")[0] for m in sys.modules})))
"""


def _setup_cfg() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg


def _names(requirements: str) -> list[str]:
    """The distribution names of a setup.cfg requirement list (no versions, extras or comments)."""
    lines = [line.split("#")[0].strip() for line in requirements.splitlines()]
    return [re.split(r"[\[<>=!~; ]", line)[0].lower() for line in lines if line]


def _module(distribution: str) -> str:
    return MODULE_OF.get(distribution, distribution.replace("-", "_"))


def _extras() -> dict[str, set[str]]:
    """Each extra but the test and benchmark ones, as the top-level modules of its packages."""
    extras = _setup_cfg()["options.extras_require"]
    return {
        name: {_module(d) for d in _names(reqs)}
        for name, reqs in extras.items()
        if name not in ("dev", "bench")
    }


#: what an extra's packages bring themselves that another extra also names (the mcp package
#: depends on opentelemetry-api, which the server extra names for its traces)
BROUGHT_BY = {"mcp": {"opentelemetry"}}


def _refused(allowed: tuple[str, ...]) -> set[str]:
    refused = set().union(*(mods for name, mods in _extras().items() if name not in allowed))
    refused -= set().union(*(BROUGHT_BY.get(name, set()) for name in allowed))
    return refused - {_module(d) for d in _names(_setup_cfg()["options"]["install_requires"])}


def _run(refused: set[str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", REFUSING, json.dumps(sorted(refused)), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_the_base_install_is_the_client_alone() -> None:
    base = set(_names(_setup_cfg()["options"]["install_requires"]))
    assert base <= CLIENT_REQUIREMENTS, f"{base - CLIENT_REQUIREMENTS}: a server package belongs in an extra"
    server = _extras()["server"]
    assert {"libvirt", "zstandard", "prometheus_client", "structlog", "msgpack"} <= server


#: modules we import that come with a declared package rather than being declared themselves
PROVIDED_BY = {
    "yarl": "aiohttp",
    "libvirt_qemu": "libvirt",
    "anyio": "mcp",
    "pydantic": "mcp",
    "mcp_types": "mcp",
}


def test_every_package_the_code_imports_is_declared() -> None:
    """A server module importing what only a test or benchmark dependency brought (``packaging``
    came with ipykernel once) breaks ``pip install 'kernelhost[server]'``: each third-party
    import of kernelhost/ and hypervisor/ is in install_requires or a non-test extra."""
    declared = {_module(d) for d in _names(_setup_cfg()["options"]["install_requires"])}
    declared |= set().union(*_extras().values())
    undeclared = {}
    for path in sorted([*(REPO / "kernelhost").rglob("*.py"), *(REPO / "hypervisor").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top in sys.stdlib_module_names or top in ("kernelhost", "hypervisor"):
                    continue
                if PROVIDED_BY.get(top, top) not in declared:
                    undeclared[top] = str(path.relative_to(REPO))
    assert not undeclared, f"imported but in no extra of setup.cfg: {undeclared}"


def test_the_commands_hints_name_the_extras_of_setup_cfg() -> None:
    extras = _extras()
    for module, extra in EXTRA_OF_MODULE.items():
        assert module in extras[extra], f"cli/extras.py: {module} is not in setup.cfg's {extra} extra"


@pytest.mark.parametrize("entry_point", sorted(ENTRY_POINTS))
def test_each_client_entry_point_imports_without_the_server(entry_point: str) -> None:
    refused = _refused(ENTRY_POINTS[entry_point])
    assert {"libvirt", "zstandard", "prometheus_client"} <= refused
    proc = _run(refused, entry_point)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert not loaded & refused


def test_serve_without_the_server_extra_says_what_to_install() -> None:
    proc = _run(_refused(()), "--command", "serve", "--port", "1")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pip install 'kernelhost[server]'" in proc.stderr, proc.stderr


def test_kernelspec_without_the_jupyter_extra_says_what_to_install(tmp_path: Path) -> None:
    proc = _run(_refused(()), "--command", "kernelspec", "install", "--prefix", str(tmp_path))
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "pip install 'kernelhost[jupyter]'" in proc.stderr, proc.stderr
