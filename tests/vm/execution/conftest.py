"""The execution tests' own ``kernelhost serve`` (package scoped: started once for every module
here), because two of them need a shape the shared service does not have:
``print('x' * 10**9)`` builds a 1 GB string in the guest, so its VMs get 1536 MiB, and the
ladder's rungs are shortened (grace 3 s, agent timeout 5 s) so the whole ladder is exercised in
seconds. Tests that end in a fresh VM use a sandbox of their own.

Fixture graph (package scoped)::

    execution_service ──> py  (python sandbox)        shared by read-mostly tests
                  └─> ds  (python-datasci sandbox)
                  └─> fresh (function)            a new python sandbox, closed after the test
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kernelhost import AsyncSandbox

from ...harness import REPO, Service
from .common import AGENT_TIMEOUT, GRACE, MAX_FILE, MAX_OUTPUT, MAX_RESULT


@pytest.fixture(scope="package")
def execution_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    svc = Service.make(
        tmp_path_factory.mktemp("execution"),
        KERNELHOST_VM_MEMORY_MIB="1536",
        KERNELHOST_POOL_SIZE="1",
        KERNELHOST_INTERRUPT_GRACE=str(GRACE),
        KERNELHOST_AGENT_TIMEOUT=str(AGENT_TIMEOUT),
        KERNELHOST_RESTART_TIMEOUT="60",
        KERNELHOST_MAX_OUTPUT_BYTES=str(MAX_OUTPUT),
        KERNELHOST_MAX_RESULT_BYTES=str(MAX_RESULT),
        KERNELHOST_MAX_FILE_BYTES=str(MAX_FILE),
    )
    svc.start()
    try:
        yield svc
    finally:
        leaked, leaked_dirs = svc.cleanup()
        (REPO / "results").mkdir(exist_ok=True)
        (REPO / "results" / "vm-execution-service.log").write_bytes(svc.log_path.read_bytes())
        assert not leaked, f"domains left behind: {leaked}"
        assert not leaked_dirs, f"VM directories left behind: {leaked_dirs}"


def _open(svc: Service, template: str = "python") -> AsyncSandbox:
    return AsyncSandbox(template=template, url=svc.url, api_key=svc.api_key)


@pytest.fixture(scope="package")
async def py(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service) as sbx:
        yield sbx


@pytest.fixture(scope="package")
async def ds(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service, "python-datasci") as sbx:
        yield sbx


@pytest.fixture
async def fresh(execution_service: Service) -> AsyncIterator[AsyncSandbox]:
    async with _open(execution_service) as sbx:
        yield sbx
