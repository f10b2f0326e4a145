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


TIERS = ("unit", "vm", "clients", "cluster", "bench")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test belongs to a tier: `make test` selects by tier marker, so a test without one
    would never run there (two unit modules went unrun that way)."""
    untiered = [i.nodeid for i in items if not any(i.get_closest_marker(t) for t in TIERS)]
    if untiered:
        raise pytest.UsageError(
            f"tests without a tier marker ({', '.join(TIERS)}): {untiered[:5]}; "
            "add e.g. `pytestmark = pytest.mark.unit` to their module"
        )
