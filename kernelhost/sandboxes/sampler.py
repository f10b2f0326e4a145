"""Each running sandbox's CPU, memory and disk over time (``sandbox_metrics_interval``).

``UsageSampler.run`` is a background task of the service: every interval it reads every running
VM once and appends one ``Sample`` to that sandbox's ring, the last ``SAMPLES_KEPT`` samples
packed into about 100 bytes each (about 75 KiB per sandbox at most). A ring goes with its
sandbox: readers see live sandboxes only, and each pass drops the rings of the gone.

One pass costs:
- one host-side read of the VMs (``VmBackend.stats``: /proc of each QEMU, tens of microseconds,
  no libvirt call): CPU time and QEMU's resident memory;
- per VM, one ``fs_read`` of the guest's ``/proc/meminfo`` (no process, no Jupyter; the agent
  answers it beside running code) for what the guest itself uses: its memory, and its writable
  space. That space is a tmpfs in guest RAM under the overlay, invisible from the host as a
  disk: its bytes are the guest's ``Shmem`` (the writable layer, ``/dev/shm``, ``/run``).

CPU and QEMU's memory are the host's figures; memory and disk are what the guest reports (a
hostile guest can misreport its own). A guest that does not answer within ``GUEST_TIMEOUT``
gets a sample without them. The CPU percentage is over the time since the previous sample of the
same VM (a wake or VM replacement starts over).
"""

from __future__ import annotations

import asyncio
import collections
import struct
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import structlog

from hypervisor import DomainStats, HypervisorError

from ..channel import ChannelError
from ..channel.protocol import Op
from .context import Context
from .sandbox import Sandbox

log = structlog.get_logger("kernelhost.sampler")

SAMPLES_KEPT = 720  # per sandbox: an hour at the default interval of 5 s
GUEST_TIMEOUT = 2.0  # seconds a guest gets to send its /proc/meminfo
HOST_TIMEOUT = 10.0  # seconds the host-side read of all VMs may take
MEMINFO_MAX = 16384  # bytes of /proc/meminfo read (it is about 1.5 KiB)
SLACK = 0.001  # seconds a range's ends are widened by
UNKNOWN = -1  # a figure the sample lacks (the guest did not answer)
_PACKED = struct.Struct("<dqdiqqqqqq")


class Sample(NamedTuple):
    timestamp: float  # Unix time
    cpu_ns: int  # CPU time of the sandbox's current VM since it started (host)
    cpu_used_pct: float  # of all its vCPUs, since the previous sample of the VM (-1: first)
    cpu_count: int
    host_rss: int  # QEMU's resident memory on the host
    mem_total: int  # the rest as the guest reports them; UNKNOWN if it did not answer
    mem_used: int
    mem_cache: int
    disk_used: int
    disk_total: int

    @property
    def complete(self) -> bool:
        return self.mem_total != UNKNOWN and self.cpu_used_pct >= 0


@dataclass
class _Ring:
    domain: str
    samples: collections.deque[bytes]
    last_cpu: tuple[float, int] | None = None  # (monotonic, cpu ns) of the domain's previous sample
    writable_mib: int | None = field(default=None)  # the template's writable space, if it sets one


class UsageSampler:
    """The rings of the live sandboxes, and the task that fills them."""

    def __init__(self, ctx: Context, keep: int = SAMPLES_KEPT) -> None:
        self.ctx = ctx
        self.interval = ctx.settings.sandbox_metrics_interval
        self.keep = keep
        self._rings: dict[str, _Ring] = {}

    @property
    def enabled(self) -> bool:
        return self.interval > 0

    async def run(self) -> None:
        """Sample every ``interval`` seconds until cancelled; a pass is bounded by its own
        deadline, and a failed one is logged and the next one runs."""
        loop = asyncio.get_running_loop()
        log.info("sampler.started", interval=self.interval, kept=self.keep)
        while True:
            started = loop.time()
            try:
                async with asyncio.timeout(HOST_TIMEOUT + GUEST_TIMEOUT):
                    await self.sample()
            except TimeoutError:
                log.warning("sampler.pass_timeout", seconds=HOST_TIMEOUT + GUEST_TIMEOUT)
            except HypervisorError as exc:
                log.warning("sampler.host_failed", error=str(exc))
            except Exception:
                log.exception("sampler.pass_failed")
            await asyncio.sleep(max(0.0, self.interval - (loop.time() - started)))

    async def sample(self) -> int:
        """One pass over the running sandboxes; how many were sampled."""
        live = {sbx.id: sbx for sbx in self.ctx.registry}
        self.forget(set(self._rings) - set(live))
        running = {sbx.record.domain: sbx for sbx in live.values() if sbx.live_agent is not None}
        if not running:
            self.ctx.metrics.sampled.set(0)
            return 0
        began = time.perf_counter()
        async with asyncio.timeout(HOST_TIMEOUT):
            stats = await self.ctx.vms.stats(list(running))
        mono, now = time.monotonic(), time.time()
        sampled = [(domain, running[domain]) for domain in stats]
        guests = await asyncio.gather(*(self._guest(sbx) for _, sbx in sampled))
        for (domain, sbx), guest in zip(sampled, guests, strict=True):
            self._add(sbx, domain, stats[domain], guest, mono, now)
        self.ctx.metrics.observe_sample_pass(time.perf_counter() - began, len(sampled))
        return len(sampled)

    def forget(self, ids: set[str]) -> None:
        for sandbox_id in ids:
            self._rings.pop(sandbox_id, None)

    def _add(
        self, sbx: Sandbox, domain: str, st: DomainStats, guest: Guest | None, mono: float, now: float
    ) -> None:
        vcpus = max(1, sbx.record.vcpus)
        ring = self._rings.get(sbx.id)
        if ring is None:
            ring = self._rings[sbx.id] = _Ring(domain, collections.deque(maxlen=self.keep))
            ring.writable_mib = self._writable_mib(sbx)
        if ring.domain != domain:  # a new VM: its CPU time starts over
            ring.domain, ring.last_cpu = domain, None
        pct = -1.0
        if ring.last_cpu is not None and mono > ring.last_cpu[0]:
            wall_ns = (mono - ring.last_cpu[0]) * 1e9 * vcpus
            pct = round(min(100.0, max(0.0, (st.cpu_ns - ring.last_cpu[1]) * 100 / wall_ns)), 2)
        ring.last_cpu = (mono, st.cpu_ns)
        g = guest or Guest(UNKNOWN, UNKNOWN, UNKNOWN, UNKNOWN)
        disk_total = UNKNOWN
        if guest is not None:
            disk_total = ring.writable_mib * 2**20 if ring.writable_mib else guest.mem_total // 2
        sample = Sample(
            now,
            st.cpu_ns,
            pct,
            vcpus,
            st.rss_bytes,
            g.mem_total,
            g.mem_used,
            g.mem_cache,
            g.shmem,
            disk_total,
        )
        ring.samples.append(_PACKED.pack(*sample))

    def _writable_mib(self, sbx: Sandbox) -> int | None:
        """The writable space its template sets (None: half the guest's RAM, the default)."""
        try:
            vm = self.ctx.images.get(sbx.record.template).manifest.get("vm") or {}
            return int(vm.get("writable_mib") or 0) or None
        except (OSError, ValueError, TypeError, HypervisorError):
            return None

    async def _guest(self, sbx: Sandbox) -> Guest | None:
        agent = sbx.live_agent
        if agent is None:
            return None
        try:
            reply = await agent.request(
                Op.FS_READ, timeout=GUEST_TIMEOUT, path="/proc/meminfo", offset=0, length=MEMINFO_MAX
            )
            return parse_meminfo(reply.get("data"))
        except (ChannelError, ValueError, KeyError) as exc:
            log.debug("sampler.guest_unread", sandbox_id=sbx.id, error=str(exc))
            return None

    # -- reading -----------------------------------------------------------------------------------

    def samples(self, sandbox_id: str, start: float | None = None, end: float | None = None) -> list[Sample]:
        """A live sandbox's samples from ``start`` to ``end`` (Unix times, give or take a
        millisecond: a time that went through a ``datetime`` is rounded to microseconds), oldest
        first."""
        ring = self._rings.get(sandbox_id)
        if ring is None or self.ctx.registry.find(sandbox_id) is None:
            return []
        found = (Sample(*_PACKED.unpack(b)) for b in list(ring.samples))
        return [
            s
            for s in found
            if (start is None or s.timestamp >= start - SLACK) and (end is None or s.timestamp <= end + SLACK)
        ]

    def latest(self) -> list[tuple[Sandbox, Sample]]:
        """Each live sandbox with its last sample (those with none are left out)."""
        found = []
        for sbx in self.ctx.registry:
            ring = self._rings.get(sbx.id)
            if ring is not None and ring.samples:
                found.append((sbx, Sample(*_PACKED.unpack(ring.samples[-1]))))
        return found

    def __len__(self) -> int:
        """Sandboxes with a ring (what the sampler holds)."""
        return len(self._rings)


class Guest(NamedTuple):
    mem_total: int
    mem_used: int
    mem_cache: int
    shmem: int


def parse_meminfo(data: object) -> Guest:
    """The guest's ``/proc/meminfo``, checked (it comes from the guest)."""
    if not isinstance(data, bytes):
        raise ValueError("the guest sent no /proc/meminfo")
    kib: dict[str, int] = {}
    for line in data.decode("ascii", "replace").splitlines()[:200]:
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit() and len(words[0]) <= 15:
            kib[name.strip()] = int(words[0]) * 1024
    total, available = kib["MemTotal"], kib["MemAvailable"]
    used = min(total, max(0, total - available))
    cache = kib.get("Cached", 0) + kib.get("Buffers", 0)
    return Guest(total, used, min(cache, total), min(kib.get("Shmem", 0), total))
