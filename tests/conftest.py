"""Shared test configuration; tier fixtures live in tests/unit, tests/agent, tests/vm and
tests/clients.

A test that fails in a tier with real services (vm, clients) leaves its evidence under
``results/failures/<test>/``: the log of every service running at that moment, and the domain
XML and serial console of each of their VMs, saved before the fixtures tear them down.
"""

from __future__ import annotations

import re
from collections.abc import Generator
from typing import Any

import pytest

from .harness import LIVE, REPO


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed and report.when in ("setup", "call") and LIVE:
        name = re.sub(r"[^A-Za-z0-9_.-]+", "_", item.nodeid)[-150:]
        for n, service in enumerate(list(LIVE)):
            service.save_evidence(REPO / "results" / "failures" / name / f"service-{n}")
    return report
