"""LangChain's standard sandbox tests (``SandboxIntegrationTests`` from ``langchain-tests``)
through ``langchain-e2b``'s ``E2BSandbox``, over the service's E2B surface: this module is all of
it that lives here, the subclass saying how to make a sandbox, as every vendor's does.

Not collected by the project's pytest (its name does not start with ``test_``):
test_langchain_suite.py runs it in a virtualenv of its own with the E2B_* variables set."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import e2b
import pytest
from langchain_e2b import E2BSandbox
from langchain_tests.integration_tests import SandboxIntegrationTests


class TestKernelhostE2BSandbox(SandboxIntegrationTests):  # type: ignore[misc]  # no types there
    @pytest.fixture(scope="class")
    @classmethod
    def sandbox(cls) -> Iterator[Any]:
        sbx = e2b.Sandbox.create(metadata={"suite": "langchain-tests"})
        try:
            yield E2BSandbox(sandbox=sbx)
        finally:
            sbx.kill()
