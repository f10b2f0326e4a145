"""Fixtures for the VM tier: a real ``kernelhost serve`` on real libvirt, QEMU and guest image.

Fixture graph (session scoped unless noted)::

    service ──> client_env                   a running service with two API keys; the SDK's
       │                                     KERNELHOST_URL / KERNELHOST_API_KEY point at it
       ├──> sandbox                          one shared AsyncSandbox for read-mostly tests
       └──> fresh_sandbox (function)         a new sandbox, closed after the test

Each run uses its own domain prefix and state directory, so it never touches another service's
VMs; at teardown it asserts that no domain and no VM directory of that prefix is left. The
service log is copied to ``results/vm-service.log``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kernelhost import AsyncSandbox

from ..harness import Service, running_service


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(tmp_path_factory.mktemp("state"), "vm", KERNELHOST_REAPER_INTERVAL="1") as svc:
        yield svc


@pytest.fixture(scope="session")
def client_env(service: Service, monkeypatch_session: pytest.MonkeyPatch) -> Service:
    monkeypatch_session.setenv("KERNELHOST_URL", service.url)
    monkeypatch_session.setenv("KERNELHOST_API_KEY", service.api_key)
    return service


@pytest.fixture(scope="session")
def monkeypatch_session() -> Iterator[pytest.MonkeyPatch]:
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="session")
async def sandbox(client_env: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(template="python")
    try:
        yield sbx
    finally:
        await sbx.close()


@pytest.fixture
async def fresh_sandbox(client_env: Service) -> AsyncIterator[AsyncSandbox]:
    sbx = await AsyncSandbox.create(template="python")
    try:
        yield sbx
    finally:
        await sbx.close()
