"""LangChain's standard sandbox tests, unmodified, against real VMs through the E2B surface:
``SandboxIntegrationTests`` (langchain-tests) driving langchain-e2b's ``E2BSandbox``, the same
file Daytona, Modal, Runloop and E2B itself run. langchain_sandbox.py is the subclass.

langchain-e2b pulls deepagents, langgraph and LangChain's model packages, and langchain-tests
pulls pytest plugins (pytest-socket, syrupy, vcrpy, ...) and an older tenacity: in the project's
virtualenv they would load into every test run, so the suite gets a virtualenv of its own,
built on the first run and cached (suite_support.suite_venv). Every case must pass; none is
left out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ...harness import Service
from ..suite_support import run_pytest, suite_venv
from .conftest import e2b_env

pytestmark = [pytest.mark.clients, pytest.mark.timeout(1800)]

REQUIREMENTS = ["langchain-tests==1.1.9", "langchain-e2b==0.0.6"]
MODULE = Path(__file__).with_name("langchain_sandbox.py")
CASES = 86  # SandboxIntegrationTests' 85 and BaseStandardTests' no-overrides check
#: async cases are plain ``async def`` (LangChain's own repository runs them in auto mode)
INI = "asyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"


def test_langchain_standard_sandbox_suite_passes(agents_service: Service, tmp_path: Path) -> None:
    python = suite_venv("langchain", REQUIREMENTS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("E2B_") and k != "PYTHONPATH"}
    counts = run_pytest(
        python,
        ["--import-mode=importlib", "--noconftest", str(MODULE)],  # not the project's conftest files
        cwd=tmp_path,
        env={**env, **e2b_env(agents_service)},
        report=tmp_path / "langchain.xml",
        ini=INI,
        timeout=1500,  # under the test's own limit: a hung suite is killed and reported
    )
    counts.report("langchain-tests 1.1.9 SandboxIntegrationTests (langchain-e2b 0.0.6)")
    assert not counts.problems, "\n".join(f"{k}: {v}" for k, v in counts.problems.items())
    assert not counts.skips, counts.skips
    assert counts.passed == CASES, counts.output[-3000:]
