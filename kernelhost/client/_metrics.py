"""A sandbox's CPU, memory and disk over time in the SDK: ``SandboxMetrics`` and the method
``AsyncSandbox`` gets for them (``get_metrics``)."""

from __future__ import annotations

import builtins
import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kernelhost.client._exceptions import TransportError

if TYPE_CHECKING:
    from kernelhost.client._http import HTTPClient


@dataclass(frozen=True)
class SandboxMetrics:
    """One sample of a sandbox, taken by the server every ``sandbox_metrics_interval`` seconds.

    ``cpu_used_pct`` is of all its vCPUs since the previous sample (None for the first sample
    of a VM); ``cpu_seconds`` the CPU time of its current VM. Memory and disk are in bytes, as
    the guest reports them (None when it did not answer in time); the disk is the sandbox's
    writable space, which lives in its RAM. ``host_memory_bytes`` is what its VM holds on the
    host.
    """

    timestamp: dt.datetime
    cpu_count: int
    cpu_used_pct: float | None
    cpu_seconds: float
    host_memory_bytes: int
    mem_total: int | None
    mem_used: int | None
    mem_cache: int | None
    disk_used: int | None
    disk_total: int | None

    @classmethod
    def from_wire(cls, obj: Any) -> SandboxMetrics:
        if not isinstance(obj, dict) or not isinstance(obj.get("timestamp_unix"), int | float):
            raise TransportError(f"expected a metrics sample, the server sent {obj!r:.300}")

        def count(name: str) -> int | None:
            value = obj.get(name)
            return int(value) if isinstance(value, int | float) else None

        pct = obj.get("cpu_used_pct")
        return cls(
            timestamp=dt.datetime.fromtimestamp(float(obj["timestamp_unix"]), dt.UTC),
            cpu_count=int(obj.get("cpu_count") or 0),
            cpu_used_pct=float(pct) if isinstance(pct, int | float) else None,
            cpu_seconds=float(obj.get("cpu_seconds") or 0.0),
            host_memory_bytes=int(obj.get("host_memory_bytes") or 0),
            mem_total=count("mem_total"),
            mem_used=count("mem_used"),
            mem_cache=count("mem_cache"),
            disk_used=count("disk_used"),
            disk_total=count("disk_total"),
        )


def _unix(when: dt.datetime | float | None, name: str) -> str | None:
    if when is None:
        return None
    if isinstance(when, dt.datetime):
        return repr(when.timestamp())  # a naive datetime is local time, as datetime has it
    if isinstance(when, int | float) and not isinstance(when, bool):
        return repr(float(when))
    raise ValueError(f"{name} must be a datetime or a Unix time in seconds, got {when!r}")


class MetricsMethods:
    """Mixed into ``AsyncSandbox``."""

    _http: HTTPClient

    @property
    def id(self) -> str:
        raise NotImplementedError

    def _ensure_open(self) -> None:
        raise NotImplementedError

    async def get_metrics(
        self, start: dt.datetime | float | None = None, end: dt.datetime | float | None = None
    ) -> builtins.list[SandboxMetrics]:
        """The sandbox's CPU, memory and disk samples from ``start`` to ``end`` (datetimes or
        Unix times; default: all the server keeps, the last hour at its default interval),
        oldest first. Empty while none were taken (the server samples every few seconds, or
        not at all if its operator turned that off)."""
        self._ensure_open()
        query = {k: v for k, v in (("start", _unix(start, "start")), ("end", _unix(end, "end"))) if v}
        reply = await self._http.request("GET", f"/v1/sandboxes/{self.id}/metrics", params=query or None)
        items = reply.get("samples") if isinstance(reply, dict) else None
        if not isinstance(items, builtins.list):
            raise TransportError(f"the metrics came without a 'samples' list: {reply!r:.300}")
        return [SandboxMetrics.from_wire(item) for item in items]
