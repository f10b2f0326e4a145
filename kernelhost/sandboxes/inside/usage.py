"""What a running sandbox uses now: CPU, memory and disk, as E2B's ``get_metrics`` shows it.

CPU comes from the host (libvirt's CPU time of the VM's vCPUs, over the time since the previous
reading, or over a short window for the first); memory and disk from inside the guest (its
``/proc/meminfo`` and the writable space under ``/home/user``), read by a background process,
so a reading never waits for the code that runs in the kernel. One reading per call: E2B's
``get_metrics`` takes one when the sampler (``sampler.py``, the samples over time) has none for
the sandbox yet, or is off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

from ..context import Context
from ..errors import AgentUnresponsive
from ..execution import End, Stream
from ..sandbox import Sandbox, ensure_usable
from .processes import Processes

FIRST_WINDOW = 0.5  # seconds of CPU time measured when a sandbox has no earlier reading
READING_TIMEOUT = 30.0
LAST_KEPT = 4096  # sandboxes whose last CPU reading is kept (the oldest go first)
PROBE = "cat /proc/meminfo; echo '--'; df -P -B1 /home/user | tail -n 1"


@dataclass(frozen=True)
class Usage:
    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


class UsageMeter:
    """Readings of running sandboxes (the last CPU time of each, for the next one's delta)."""

    def __init__(self, ctx: Context, processes: Processes) -> None:
        self.ctx = ctx
        self.processes = processes
        self._last: dict[str, tuple[float, int]] = {}  # sandbox id -> (monotonic, cpu ns)

    async def read(self, sbx: Sandbox) -> Usage:
        ensure_usable(sbx)
        guest = asyncio.ensure_future(self._guest(sbx))
        try:
            cpu_pct, vcpus = await self._cpu(sbx)
            mem_total, mem_used, mem_cache, disk_total, disk_used = await guest
        finally:
            guest.cancel()
        return Usage(time.time(), vcpus, cpu_pct, mem_used, mem_total, mem_cache, disk_used, disk_total)

    async def _cpu(self, sbx: Sandbox) -> tuple[float, int]:
        domain = sbx.record.domain
        now = time.monotonic()
        before = self._last.get(sbx.id)
        if before is None:
            cpu_ns, _ = await self.ctx.vms.cpu_time(domain)
            before = (now, cpu_ns)
            await asyncio.sleep(FIRST_WINDOW)
        cpu_ns, vcpus = await self.ctx.vms.cpu_time(domain)
        now = time.monotonic()
        self._last.pop(sbx.id, None)
        self._last[sbx.id] = (now, cpu_ns)
        while len(self._last) > LAST_KEPT:
            del self._last[next(iter(self._last))]
        wall_ns = max(1.0, (now - before[0]) * 1e9) * max(1, vcpus)
        return round(min(100.0, max(0.0, (cpu_ns - before[1]) * 100 / wall_ns)), 2), vcpus

    async def _guest(self, sbx: Sandbox) -> tuple[int, int, int, int, int]:
        """(memory total, used, cached; disk total, used) in bytes, from inside the guest."""
        proc = await self.processes.start(sbx, PROBE, timeout=READING_TIMEOUT, info={"usage": True}, own=True)
        out: list[str] = []
        async with contextlib.aclosing(proc.listen()) as events:
            async for event in events:
                if isinstance(event, Stream) and event.name == "stdout":
                    out.append(event.text)
                elif isinstance(event, End):
                    break
        try:
            return parse_probe("".join(out))
        except (ValueError, IndexError, KeyError) as exc:
            raise AgentUnresponsive(
                f"sandbox {sbx.id} did not report its memory and disk ({exc})", sandbox_id=sbx.id
            ) from None


def parse_probe(text: str) -> tuple[int, int, int, int, int]:
    meminfo, df = text.split("--\n", 1)
    kib = {}
    for line in meminfo.splitlines():
        name, _, rest = line.partition(":")
        if rest.strip():
            kib[name] = int(rest.split()[0]) * 1024
    total, available = kib["MemTotal"], kib["MemAvailable"]
    cache = kib.get("Cached", 0) + kib.get("Buffers", 0)
    fields = df.split()
    return total, total - available, cache, int(fields[1]), int(fields[2])
