"""``with_keepalives`` (api/e2b/common.py): a stream closed while it waits for its next item
(a client that leaves a WatchDir stream) closes the stream it reads without a RuntimeError."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator

import pytest

from kernelhost.api.e2b.common import with_keepalives

pytestmark = pytest.mark.unit


async def test_closing_while_an_item_is_awaited_closes_the_source_cleanly() -> None:
    closed = asyncio.Event()

    async def source() -> AsyncGenerator[int, None]:
        try:
            yield 1
            await asyncio.Event().wait()  # the watcher's next event never comes
            yield 2
        finally:
            closed.set()

    lines = source()
    async with contextlib.aclosing(lines):
        async with contextlib.aclosing(with_keepalives(lines, 0.01)) as items:
            seen = [await anext(items), await anext(items)]
    assert seen == [1, None]  # the item, then a keepalive while the next one is awaited
    assert closed.is_set()
