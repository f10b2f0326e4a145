"""Issue 37, items 15 and 16: E2B's code contexts are kernels of their own, through E2B's own
SDK (``e2b-code-interpreter``, unmodified) and real VMs. Before, ``create_code_context()``
returned the sandbox's one kernel (state shared), refused a ``cwd`` and could not be removed,
and ``run_code(language=...)`` knew only the main kernel's language and bash."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ...harness import Service

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


@pytest.fixture
def sandbox(e2b: Service) -> Iterator[Any]:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(metadata={"suite": "contexts"})
    try:
        yield sbx
    finally:
        sbx.kill()


def _text(sbx: Any, code: str, **where: Any) -> str | None:
    execution = sbx.run_code(code, **where)
    assert execution.error is None, execution.error
    return execution.text  # type: ignore[no-any-return]


def _printed(sbx: Any, code: str, **where: Any) -> str:
    """What ``code`` printed (IRkernel shows a value as a display, not a main result)."""
    execution = sbx.run_code(code, **where)
    assert execution.error is None, execution.error
    return "".join(execution.logs.stdout)


def test_15_contexts_have_their_own_variables_cwd_restart_and_removal(sandbox: Any) -> None:
    from e2b.exceptions import NotFoundException

    sandbox.run_code("shared = 'main'")
    one = sandbox.create_code_context(cwd="/tmp/one")
    two = sandbox.create_code_context(language="python")
    assert (one.language, one.cwd) == ("python", "/tmp/one")
    assert two.cwd == "/home/user" and len({one.id, two.id, "python"}) == 3

    sandbox.run_code("x = 1", context=one)
    sandbox.run_code("x = 2", context=two)
    assert _text(sandbox, "x", context=one) == "1"
    assert _text(sandbox, "x", context=two) == "2"
    assert _text(sandbox, "'x' in dir()") == "False"  # the main kernel has none of them
    assert _text(sandbox, "'shared' in dir()", context=one) == "False"
    assert _text(sandbox, "import os; os.getcwd()", context=one) == "/tmp/one"  # made for it
    assert _text(sandbox, "import os; os.getcwd()", context=two) == "/home/user"
    pids = {_text(sandbox, "import os; os.getpid()", context=c) for c in (one, two)}
    pids.add(_text(sandbox, "import os; os.getpid()"))
    assert len(pids) == 3  # three kernel processes

    listed = {c.id: c for c in sandbox.list_code_contexts()}
    assert {one.id, two.id} <= set(listed) and listed[one.id].cwd == "/tmp/one"

    sandbox.restart_code_context(one)
    assert _text(sandbox, "'x' in dir()", context=one) == "False"
    assert _text(sandbox, "x", context=two) == "2"  # the other context kept its state
    assert _text(sandbox, "shared") == "main"
    assert _text(sandbox, "import os; os.getcwd()", context=one) == "/tmp/one"

    sandbox.remove_code_context(two.id)
    assert two.id not in {c.id for c in sandbox.list_code_contexts()}
    with pytest.raises(NotFoundException, match=two.id):
        sandbox.run_code("x", context=two)
    with pytest.raises(NotFoundException):
        sandbox.remove_code_context(two.id)


def test_15_an_interrupted_context_keeps_its_state_and_leaves_the_others_alone(sandbox: Any) -> None:
    from e2b.exceptions import TimeoutException

    ctx = sandbox.create_code_context()
    sandbox.run_code("kept = 'yes'", context=ctx)
    sandbox.run_code("main_var = 'main'")
    # the SDK's deadline ends the request; the service then stops the context's cell
    with pytest.raises(TimeoutException):
        sandbox.run_code("import time; time.sleep(600)", context=ctx, timeout=3)
    assert _text(sandbox, "kept", context=ctx) == "yes"
    assert _text(sandbox, "main_var") == "main"


def test_15_contexts_come_through_a_pause_and_end_with_a_filesystem_one(sandbox: Any) -> None:
    from e2b.exceptions import NotFoundException
    from e2b_code_interpreter import Sandbox

    ctx = sandbox.create_code_context(cwd="/tmp/ctx")
    sandbox.run_code("held = 'in memory'", context=ctx)
    sandbox.pause()  # the whole VM, its context kernels with it
    again = Sandbox.connect(sandbox.sandbox_id)
    assert _text(again, "held", context=ctx) == "in memory"
    again.pause(mode="filesystem")  # the files only: no process is left, contexts neither
    third = Sandbox.connect(sandbox.sandbox_id)
    assert ctx.id not in {c.id for c in third.list_code_contexts()}
    with pytest.raises(NotFoundException):
        third.run_code("held", context=ctx)


def test_16_language_opens_a_context_on_the_kernel_the_template_holds(e2b: Service) -> None:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(template="r", metadata={"suite": "contexts-r"})
    try:
        assert _printed(sbx, "x <- 40 + 2; cat(x)") == "42"  # R is its main kernel
        # Python is the other kernel this template's image holds: its default context
        assert _text(sbx, "import sys; sys.version_info[0]", language="python") == "3"
        assert _text(sbx, "y = 7", language="python") is None
        assert _text(sbx, "y * 6", language="python") == "42"  # the same default context
        r_ctx = sbx.create_code_context(language="r")
        assert _printed(sbx, "cat(exists('x'))", context=r_ctx) == "FALSE"  # an R kernel of its own
        assert _printed(sbx, "cat(R.version$language)", context=r_ctx) == "R"
        languages = {c.language for c in sbx.list_code_contexts()}
        assert {"r", "python", "bash"} <= languages
    finally:
        sbx.kill()


def test_16_a_language_no_kernel_holds_is_refused_naming_what_there_is(sandbox: Any) -> None:
    from e2b.exceptions import SandboxException

    with pytest.raises(SandboxException, match=r"400.*'julia'.*python"):
        sandbox.run_code("1", language="julia")
