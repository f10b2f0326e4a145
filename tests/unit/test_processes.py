"""Background processes (kernelhost/sandboxes/inside/processes.py) without a VM: who hears a process's
output, from when, a listener that stops reading, and what a process refuses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from kernelhost.sandboxes import End, ExecutionStatus, InvalidRequest, ProcessNotFound, Stream
from kernelhost.sandboxes.inside import processes
from kernelhost.sandboxes.inside.processes import Process

pytestmark = pytest.mark.unit


def _process(stdin: bool = False) -> Process:
    return Process(1000, "sbx_1", "cat", {}, stdin, agent=None, agent_timeout=1.0)  # type: ignore[arg-type]


def _end() -> End:
    return End(status=ExecutionStatus.OK, duration_ms=1.0, language="bash", exit_code=0)


async def _feed(events: asyncio.Queue[Any]) -> AsyncGenerator[Any, None]:
    while (event := await events.get()) is not None:
        yield event


async def _collect(it: AsyncIterator[Any]) -> list[Any]:
    return [event async for event in it]


async def test_the_first_listener_hears_everything_a_later_one_from_when_it_listens() -> None:
    proc, feed = _process(), asyncio.Queue[Any]()
    run = asyncio.ensure_future(proc._run(_feed(feed)))
    first = asyncio.ensure_future(_collect(proc.listen()))
    await feed.put(Stream("stdout", "one\n"))
    await asyncio.sleep(0.05)
    later = asyncio.ensure_future(_collect(proc.listen()))
    await asyncio.sleep(0.05)
    await feed.put(Stream("stdout", "two\n"))
    await feed.put(_end())
    await feed.put(None)
    await asyncio.wait_for(run, 5)
    heard = await asyncio.wait_for(first, 5)
    assert [e.text for e in heard if isinstance(e, Stream)] == ["one\n", "two\n"]
    assert [e.text for e in await asyncio.wait_for(later, 5) if isinstance(e, Stream)] == ["two\n"]
    assert isinstance(heard[-1], End) and proc.end is heard[-1]
    # after its end, a listener hears just the end
    assert await _collect(proc.listen()) == [proc.end]


async def test_a_listener_that_stops_reading_is_cut_off_and_holds_no_one_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(processes, "LISTENER_EVENTS", 2)
    monkeypatch.setattr(processes, "LISTENER_PATIENCE", 0.2)
    proc, feed = _process(), asyncio.Queue[Any]()
    stuck = proc.listen()  # never read
    reader = asyncio.ensure_future(_collect(proc.listen()))
    run = asyncio.ensure_future(proc._run(_feed(feed)))
    for n in range(5):
        await feed.put(Stream("stdout", f"{n}\n"))
    await feed.put(_end())
    await feed.put(None)
    await asyncio.wait_for(run, 5)  # ended although one listener never read
    assert [e.text for e in await asyncio.wait_for(reader, 5) if isinstance(e, Stream)] == [
        f"{n}\n" for n in range(5)
    ]
    heard = await asyncio.wait_for(_collect(stuck), 5)
    assert heard[-1].name == "ListenerTooSlow" and "was not read" in heard[-1].value
    assert not any(isinstance(e, End) for e in heard)


async def test_input_needs_stdin_and_a_process_that_ended_is_not_found() -> None:
    with pytest.raises(InvalidRequest, match="started without stdin"):
        await _process(stdin=False).send_input(b"x")
    proc = _process(stdin=True)
    proc.end = _end()
    with pytest.raises(ProcessNotFound, match="no process 1000 runs in sandbox sbx_1"):
        await proc.send_input(b"x")
    with pytest.raises(InvalidRequest, match="not one of INT, TERM, KILL"):
        await proc.signal("HUP")
