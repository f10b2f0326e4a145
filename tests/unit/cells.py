"""``cell()``: run_cell with the old keyword arguments, yielding each event's JSON form."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

from kernelhost.channel import AgentClient
from kernelhost.sandboxes.execution import (
    Cell,
    CellPolicy,
    OutputLimits,
    ReplaceVm,
    RunningCall,
    run_cell,
)

from .fake_agent import WAIT


def cell(
    client: AgentClient,
    code: str = "1 + 1",
    *,
    session: str = "session-1",
    timeout: float | None = None,
    language: str = "python",
    interrupt_grace: float = WAIT,
    restart_timeout: float = 60.0,
    agent_timeout: float = 10.0,
    max_output_bytes: int | None = None,
    max_result_bytes: int | None = None,
    running: RunningCall | None = None,
    replace_vm: ReplaceVm | None = None,
    context: str | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    policy = CellPolicy(
        OutputLimits(max_output_bytes, max_result_bytes),
        interrupt_grace=interrupt_grace,
        restart_timeout=restart_timeout,
        agent_timeout=agent_timeout,
    )

    async def events() -> AsyncGenerator[dict[str, Any], None]:
        inner = run_cell(
            client,
            Cell(code, language, timeout, context=context),
            policy,
            running or RunningCall(),
            session,
            replace_vm,
        )
        async with contextlib.aclosing(inner):
            async for event in inner:
                yield event.wire()

    return events()
