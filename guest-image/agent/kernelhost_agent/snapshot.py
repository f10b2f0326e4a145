"""Snapshots, clones and resumes: ops ``prepare_snapshot`` and ``resumed``.

A template VM is warmed up (``prepare_snapshot``) and frozen; sandboxes are copy-on-write clones
of its RAM. After every restore, clone and resume the host sends ``resumed`` with the wall-clock
time and fresh entropy: otherwise every clone would share the frozen clock, the kernel RNG's
state and Python's random streams.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import struct
import time
from collections.abc import Callable, Mapping
from typing import Any

from .config import AgentConfig
from .dispatch import Handler
from .kernel import Kernel, silent_cell
from .languages import Language, language_for
from .shared import protocol

__all__ = ["Snapshots", "add_entropy"]

WARM_UP_TIMEOUT = 120.0
RESEED_TIMEOUT = 30.0
ENTROPY_MAX = 512
RNDADDENTROPY = 0x40085203  # _IOW('R', 0x03, int[2])
RNDRESEEDCRNG = 0x5207  # _IO('R', 0x07)


class Snapshots:
    """The snapshot area."""

    capability = protocol.Capability.SNAPSHOT

    def __init__(
        self, config: AgentConfig, kernel: Kernel, contexts: Callable[[], list[Kernel]] = list
    ) -> None:
        self.config = config
        self.kernel = kernel
        #: the code contexts' kernels: reseeded with the main one after a clone. A template is
        #: frozen before any user starts one, so ``prepare_snapshot`` warms the main kernel only.
        self.contexts = contexts
        self.language = language_for(config.language)

    def ops(self) -> Mapping[str, Handler]:
        """prepare_snapshot and resumed."""
        return {
            protocol.Op.PREPARE_SNAPSHOT: self.op_prepare_snapshot,
            protocol.Op.RESUMED: self.op_resumed,
        }

    async def op_prepare_snapshot(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Warm the kernel before its VM is frozen into a template: import the template's heavy
        modules, collect garbage, and drop the guest's page cache so the RAM file holds less."""
        preload = frame.get("preload", [])
        if not isinstance(preload, list):
            raise ValueError(f"preload must be a list of module names, got {type(preload).__name__}")
        modules = [m for m in preload if isinstance(m, str) and m]
        for module in modules:
            self.language.check_preload(module)
        await self.kernel.until_ready()
        t0 = time.monotonic()
        lang = self.language
        for module in modules:
            await self.kernel.run_silent(lang.load(module), timeout=WARM_UP_TIMEOUT)
        # the modules a user's first call imports lazily are in RAM before the page cache is
        # dropped, so a clone's first call is not the slow one
        await warm_up(self.kernel, lang)
        if lang.collect is not None:
            await self.kernel.run_silent(lang.collect)
        await self._warm_standby(modules)
        gc.collect()
        if self.config.drop_caches:
            os.sync()
            _drop_page_cache()
        return {"preloaded": modules, "seconds": round(time.monotonic() - t0, 3)}

    async def _warm_standby(self, modules: list[str]) -> None:
        """The standby kernel, started and warmed like the kernel, so that every clone of the
        template has it and a restart gives a kernel like a new sandbox's."""
        standby = self.kernel.standby
        if not await self.kernel.until_standby(self.config.ready_timeout) or standby is None:
            return
        lang = self.language
        cells = [lang.load(m) for m in modules] + list(lang.warm_up_cells)
        for code in [*cells, *(c for c in (lang.cleanup, lang.collect) if c is not None)]:
            await standby.run(code, timeout=WARM_UP_TIMEOUT)

    async def op_resumed(self, frame: dict[str, Any]) -> dict[str, Any]:
        """After a restore, clone or resume: set the clock from the host, mix fresh entropy into
        the kernel RNG and reseed it, and reseed Python's ``random`` (and numpy's global RNG) in
        the kernel and in every code context's, so no two sandboxes share a random stream or a
        stale clock."""
        t0 = time.monotonic()
        time_ns = frame.get("time_ns")
        if isinstance(time_ns, int) and not isinstance(time_ns, bool):
            if self.config.set_clock:
                time.clock_settime_ns(time.CLOCK_REALTIME, time_ns)
        entropy = frame.get("entropy")
        if isinstance(entropy, bytes) and entropy:
            if self.config.add_entropy:
                add_entropy(entropy)
        await asyncio.gather(*(_reseed(k) for k in [self.kernel, *self.contexts()]))
        return {"seconds": round(time.monotonic() - t0, 4)}


async def _reseed(kernel: Kernel) -> None:
    await kernel.until_ready()
    await kernel.reseed(timeout=RESEED_TIMEOUT)


class WarmUp:
    """``warm_up``: the cells a user's first call takes, run once in a clone before the pool hands
    it out, so that its pages are faulted in and, under emulation, its code translated; with no
    history and the warm-up's traces removed (no execution count, no ``_``)."""

    capability = protocol.Capability.WARM_UP

    def __init__(self, kernel: Kernel, language: str) -> None:
        self.kernel = kernel
        self.language = language_for(language)

    def ops(self) -> Mapping[str, Handler]:
        """warm_up."""
        return {protocol.Op.WARM_UP: self.op_warm_up}

    async def op_warm_up(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Run the language's warm-up cells and clean up after them."""
        await self.kernel.until_ready()
        t0 = time.monotonic()
        await warm_up(self.kernel, self.language)
        return {"seconds": round(time.monotonic() - t0, 4)}


async def warm_up(kernel: Kernel, lang: Language) -> None:
    """One ordinary cell of each kind a user's first call takes (a value, output, an error's
    traceback), then the cleanup of what they left (``_``, ``Out``, the last error). No
    history, so no execution count moves; their replies and output are the agent's own."""
    for code in lang.warm_up_cells:
        await kernel.request(
            "shell", "execute_request", silent_cell(code, silent=False), timeout=WARM_UP_TIMEOUT
        )
    if lang.cleanup is not None:
        await kernel.run_silent(lang.cleanup)


def _drop_page_cache() -> None:
    fd = os.open("/proc/sys/vm/drop_caches", os.O_WRONLY)
    try:
        os.write(fd, b"3\n")
    finally:
        os.close(fd)


def add_entropy(data: bytes) -> None:
    """Credit ``data`` to the kernel's entropy pool and reseed its CRNG (needs CAP_SYS_ADMIN)."""
    data = data[:ENTROPY_MAX]
    pad = (-len(data)) % 4
    info = struct.pack("ii", len(data) * 8, len(data)) + data + b"\0" * pad
    fd = os.open("/dev/random", os.O_WRONLY)
    try:
        fcntl.ioctl(fd, RNDADDENTROPY, info)
        fcntl.ioctl(fd, RNDRESEEDCRNG)
    finally:
        os.close(fd)
