"""IPython's history in VM kernels: each clone of a template snapshot starts with an empty
history of its own, and a fork's child has its parent's up to the fork and its own after."""

from __future__ import annotations

import pytest

from kernelhost import AsyncSandbox

from ..harness import Service

pytestmark = pytest.mark.vm

TAIL = "[c for _, _, c in get_ipython().history_manager.get_tail(50, raw=True, include_latest=True)]"


async def _history(sbx: AsyncSandbox) -> list[str]:
    execution = await sbx.run_code(TAIL)
    assert execution.error is None, execution.error
    assert execution.text is not None
    cells: list[str] = eval(execution.text)  # a list of str literals, as the kernel printed it
    return [c for c in cells if c != TAIL]


async def test_clones_have_their_own_history_and_a_fork_inherits_its_parents(service: Service) -> None:
    one = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    two = await AsyncSandbox.create(url=service.url, api_key=service.api_key)
    child = None
    try:
        await one.run_code("a = 1")
        assert (await one.run_code("_ih[-2]")).text == "'a = 1'"  # In / _i work too
        assert await _history(two) == []  # a clone starts with an empty history
        await two.run_code("b = 2")
        assert await _history(one) == ["a = 1", "_ih[-2]"]
        assert await _history(two) == ["b = 2"]
        (child,) = await one.fork(1)
        await child.run_code("c = 3")
        await one.run_code("d = 4")
        assert await _history(child) == ["a = 1", "_ih[-2]", "c = 3"]
        assert await _history(one) == ["a = 1", "_ih[-2]", "d = 4"]
    finally:
        for sbx in (one, two, child):
            if sbx is not None:
                await sbx.close()
