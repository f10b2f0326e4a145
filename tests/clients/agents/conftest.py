"""Fixtures for the agent-framework adapters: the real anthropic, openai-agents and mcp
libraries, and the npm package's tests, driving a real ``kernelhost serve``.

Fixture graph (session scoped)::

    agents_service ──> agents_sandbox          one AsyncSandbox shared by the adapter tests
                  └──> agents_sync_sandbox     one blocking Sandbox (the derived sync surfaces)

The tests pass the service's url and key explicitly: nothing here changes ``os.environ``. At
teardown no domain and no VM directory of the service's prefix may be left; the service log is
kept as ``results/agents-service.log``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import pytest

from kernelhost import AsyncSandbox, Sandbox

from ...harness import Service, running_service

if TYPE_CHECKING:
    from agents.testing import ScriptedModel

#: Python that displays a 4x4 red PNG without matplotlib (the minimal template has none).
SHOW_PNG = "\n".join(
    [
        "import struct, zlib",
        "from IPython.display import Image, display",
        "def _chunk(kind, data):",
        "    return (struct.pack('>I', len(data)) + kind + data",
        "            + struct.pack('>I', zlib.crc32(kind + data) & 0xffffffff))",
        "_raw = b''.join(b'\\x00' + b'\\xff\\x00\\x00' * 4 for _ in range(4))",
        "_png = (b'\\x89PNG\\r\\n\\x1a\\n' + _chunk(b'IHDR', struct.pack('>IIBBBBB', 4, 4, 8, 2, 0, 0, 0))",
        "        + _chunk(b'IDAT', zlib.compress(_raw)) + _chunk(b'IEND', b''))",
        "display(Image(data=_png))",
    ]
)


@pytest.fixture(scope="session")
def agents_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("agents-state"), "agents", KERNELHOST_REAPER_INTERVAL="1"
    ) as svc:
        yield svc


@pytest.fixture(scope="session")
async def agents_sandbox(agents_service: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(
        url=agents_service.url, api_key=agents_service.api_key, metadata={"test": "agents"}
    )
    try:
        yield sbx
    finally:
        await sbx.close()


@pytest.fixture(scope="session")
def agents_sync_sandbox(agents_service: Service) -> Iterator[Sandbox]:
    with Sandbox(
        url=agents_service.url, api_key=agents_service.api_key, metadata={"test": "agents-sync"}
    ) as sbx:
        yield sbx


# == E2B's SDKs (test_e2b.py, test_e2b_openai_agents.py) ==================================


def e2b_env(svc: Service, key: str | None = None) -> dict[str, str]:
    """The SDKs' environment for ``svc``, once E2B's default template (``code-interpreter-v1``:
    our ``python-datasci``) has a ready sandbox."""
    svc.wait_pool("python-datasci")
    return {
        "E2B_API_URL": f"{svc.url}/e2b",
        "E2B_SANDBOX_URL": f"{svc.url}/e2b/sandbox",
        "E2B_API_KEY": key or svc.api_key,
    }


@pytest.fixture
def e2b(agents_service: Service, monkeypatch: pytest.MonkeyPatch) -> Iterator[Service]:
    """E2B's SDKs configured, as their users do, by the environment."""
    for name, value in e2b_env(agents_service).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    yield agents_service


def outputs_seen_by(model: ScriptedModel, index: int) -> dict[str, Any]:
    """The tool outputs in the input of the model's call ``index``, by call id."""
    items = model.calls[index].input
    assert isinstance(items, list)
    return {
        item["call_id"]: item["output"]
        for item in items
        if isinstance(item, dict) and item.get("type") == "function_call_output"
    }
