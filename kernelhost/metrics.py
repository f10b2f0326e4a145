"""Prometheus metrics of the service (``GET /metrics``), one registry per service.

Two kinds of figures:
- events, counted or timed where they happen, through small hooks the sandbox manager and the
  HTTP views call (``observe_create``, ``observe_end``, ``count_relayed``, ...);
- state (sandboxes by state and template, pool size and hits, VMs by acceleration), read from
  the manager at scrape time by ``StateCollector``, so a gauge can never drift from the truth.

This module imports nothing of the service: the manager and the API import it.
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; a pool hand-over takes milliseconds, a cold boot under TCG 10 s or more
LIFECYCLE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120)
SAMPLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
EXECUTE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The service's counters and histograms; ``render()`` is the scrape body."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.create_seconds = Histogram(
            "kernelhost_sandbox_create_seconds",
            "Time to create a sandbox, by how its VM came (pool, clone, boot)",
            ["template", "how"],
            buckets=LIFECYCLE_BUCKETS,
            registry=r,
        )
        self.create_failures = Counter(
            "kernelhost_sandbox_create_failures",
            "Creates that failed (the VM did not boot)",
            ["template"],
            registry=r,
        )
        self.fork_seconds = Histogram(
            "kernelhost_sandbox_fork_seconds",
            "Time to fork a sandbox into its children",
            ["template"],
            buckets=LIFECYCLE_BUCKETS,
            registry=r,
        )
        self.forked = Counter(
            "kernelhost_sandbox_forked_children", "Sandboxes made by fork", ["template"], registry=r
        )
        self.wake_seconds = Histogram(
            "kernelhost_sandbox_wake_seconds",
            "Time to wake a hibernated sandbox",
            ["template"],
            buckets=LIFECYCLE_BUCKETS,
            registry=r,
        )
        self.hibernations = Counter(
            "kernelhost_sandbox_hibernations", "Sandboxes saved to disk", ["template"], registry=r
        )
        self.execute_seconds = Histogram(
            "kernelhost_execute_seconds",
            "Wall time of one execution, from its start in the sandbox to its end event",
            ["language"],
            buckets=EXECUTE_BUCKETS,
            registry=r,
        )
        self.executions = Counter(
            "kernelhost_executions",
            "Executions by language and end status (ok, error, timeout, interrupted, restarted, kernel_died)",
            ["language", "status"],
            registry=r,
        )
        self.timeouts = Counter(
            "kernelhost_execution_timeouts",
            "Executions that hit their deadline, by the rung of the timeout ladder that stopped "
            "them (interrupted, kernel_restarted, vm_replaced, failed)",
            ["rung"],
            registry=r,
        )
        self.kernel_deaths = Counter(
            "kernelhost_kernel_deaths",
            "Kernels that died (cause=kernel: the process in the guest; cause=vm: the VM or its "
            "channel was lost)",
            ["cause"],
            registry=r,
        )
        self.connections = Counter(
            "kernelhost_network_connections",
            "Connections sandboxes asked the host to open through their network tunnels, by "
            "result (opened, refused)",
            ["result"],
            registry=r,
        )
        self.relayed = Counter(
            "kernelhost_relayed_bytes",
            "Bytes relayed between clients and sandboxes (kind: execute, files; direction: "
            "in = to the sandbox, out = to the client)",
            ["kind", "direction"],
            registry=r,
        )

        self._sampler_metrics(r)

    def _sampler_metrics(self, r: CollectorRegistry) -> None:
        self.sample_seconds = Histogram(
            "kernelhost_sampler_pass_seconds",
            "Time of one pass of the usage sampler over every running sandbox",
            buckets=SAMPLE_BUCKETS,
            registry=r,
        )
        self.sampled = Gauge(
            "kernelhost_sampler_sandboxes", "Sandboxes the usage sampler's last pass read", registry=r
        )

    # -- hooks ---------------------------------------------------------------------------------

    def observe_create(self, template: str, how: str, seconds: float) -> None:
        self.create_seconds.labels(label(template), how or "unknown").observe(seconds)

    def count_create_failure(self, template: str) -> None:
        self.create_failures.labels(label(template)).inc()

    def observe_fork(self, template: str, children: int, seconds: float) -> None:
        self.fork_seconds.labels(label(template)).observe(seconds)
        self.forked.labels(label(template)).inc(children)

    def observe_wake(self, template: str, seconds: float) -> None:
        self.wake_seconds.labels(label(template)).observe(seconds)

    def count_hibernation(self, template: str) -> None:
        self.hibernations.labels(label(template)).inc()

    def observe_end(self, language: str, status: str, recovery: str | None, seconds: float) -> None:
        """Account one execution by how it ended (and, on a timeout, the rung that stopped it)."""
        self.execute_seconds.labels(language).observe(seconds)
        self.executions.labels(language, status).inc()
        if status == "timeout":
            self.timeouts.labels(recovery or "failed").inc()

    def count_connection(self, result: str) -> None:
        self.connections.labels(result).inc()

    def count_kernel_death(self, cause: str) -> None:
        self.kernel_deaths.labels(cause).inc()

    def count_relayed(self, kind: str, direction: str, nbytes: int) -> None:
        self.relayed.labels(kind, direction).inc(nbytes)

    def observe_sample_pass(self, seconds: float, sandboxes: int) -> None:
        self.sample_seconds.observe(seconds)
        self.sampled.set(sandboxes)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def label(template: str) -> str:
    """A template as a metric label: a key's own templates are all ``custom`` (their image
    names carry the key's id, which no label may; and there may be many)."""
    return "custom" if "@" in template else template


# -- state read at scrape time ---------------------------------------------------------------------


class _Record(Protocol):
    template: str
    state: str
    accel: str


class _Sandbox(Protocol):
    @property
    def record(self) -> _Record: ...


class _Pool(Protocol):
    size: int
    hits: int
    misses: int

    def ready(self, template: str) -> int: ...


class _Manager(Protocol):
    accel: str

    @property
    def pool(self) -> _Pool: ...

    def all(self) -> list[Any]: ...

    def templates(self) -> list[str]: ...


class StateCollector(Collector):
    """Gauges and pool counters read from a live ``SandboxManager`` when scraped."""

    def __init__(self, manager: _Manager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        m = self.manager
        pool = m.pool
        templates = m.templates()
        by_state: Tally[tuple[str, str]] = Tally()
        vms: Tally[str] = Tally()
        for sbx in m.all():
            rec: _Record = sbx.record
            by_state[(str(rec.state), label(rec.template))] += 1
            if rec.state in ("running", "replacing"):
                vms[rec.accel] += 1
        sandboxes = GaugeMetricFamily(
            "kernelhost_sandboxes", "Sandboxes by state and template", labels=["state", "template"]
        )
        for (state, template), n in sorted(by_state.items()):
            sandboxes.add_metric([state, template], n)
        yield sandboxes
        yield from self._pool(pool, templates, vms)
        family = GaugeMetricFamily(
            "kernelhost_vms", "Running VMs (sandboxes and pooled clones) by acceleration", labels=["accel"]
        )
        for accel in sorted(vms.keys() | {m.accel}):
            family.add_metric([accel], vms[accel])
        yield family

    def _pool(self, pool: _Pool, templates: list[str], vms: Tally[str]) -> Iterator[Metric]:
        size = GaugeMetricFamily(
            "kernelhost_pool_ready", "Ready clones in the warm pool, by template", labels=["template"]
        )
        target = GaugeMetricFamily("kernelhost_pool_target", "Clones the warm pool keeps ready per template")
        target.add_metric([], pool.size)
        pooled = 0
        for template in templates:
            ready = pool.ready(template)
            pooled += ready
            size.add_metric([template], ready)
        yield size
        yield target
        hits = CounterMetricFamily("kernelhost_pool_hits", "Creates served from the warm pool")
        hits.add_metric([], pool.hits)
        yield hits
        misses = CounterMetricFamily("kernelhost_pool_misses", "Creates that found the warm pool empty")
        misses.add_metric([], pool.misses)
        yield misses
        vms[self.manager.accel] += pooled


# -- per-sandbox usage, for the operator (GET /metrics/sandboxes) ------------------------------------


class _Sample(Protocol):
    """``sandboxes.sampler.Sample`` (read-only fields)."""

    @property
    def timestamp(self) -> float: ...

    @property
    def cpu_ns(self) -> int: ...

    @property
    def cpu_count(self) -> int: ...

    @property
    def host_rss(self) -> int: ...

    @property
    def mem_total(self) -> int: ...

    @property
    def mem_used(self) -> int: ...

    @property
    def mem_cache(self) -> int: ...

    @property
    def disk_used(self) -> int: ...

    @property
    def disk_total(self) -> int: ...


#: (name, HELP, the sample's field); guest figures below 0 are unknown and left out
_USAGE_GAUGES = (
    ("kernelhost_sandbox_vcpus", "vCPUs of the sandbox's VM", "cpu_count"),
    ("kernelhost_sandbox_host_memory_bytes", "Resident memory of the sandbox's QEMU on the host", "host_rss"),
    ("kernelhost_sandbox_memory_total_bytes", "Memory of the guest (as the guest reports it)", "mem_total"),
    ("kernelhost_sandbox_memory_used_bytes", "Memory the guest uses, less what it could reclaim", "mem_used"),
    ("kernelhost_sandbox_memory_cache_bytes", "The guest's page cache and buffers", "mem_cache"),
    (
        "kernelhost_sandbox_disk_used_bytes",
        "Bytes of the guest's writable space (held in its RAM)",
        "disk_used",
    ),
    ("kernelhost_sandbox_disk_total_bytes", "Size of the guest's writable space", "disk_total"),
    (
        "kernelhost_sandbox_sample_timestamp_seconds",
        "When the sandbox was last sampled (Unix time)",
        "timestamp",
    ),
)
USAGE_LABELS = ["sandbox_id", "key_id", "template"]


class UsageCollector(Collector):
    """The last sample of each live sandbox, labelled by sandbox id, its key's id (never the
    key) and template: bounded by the sandboxes of this node, gone with them."""

    def __init__(self, rows: Sequence[tuple[tuple[str, str, str], _Sample]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "kernelhost_sandbox_cpu_seconds",
            "CPU time of the sandbox's VM (host side; starts over when the sandbox gets a new VM)",
            labels=USAGE_LABELS,
        )
        for labels, sample in self.rows:
            cpu.add_metric(list(labels), sample.cpu_ns / 1e9)
        yield cpu
        for name, help_text, attr in _USAGE_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=USAGE_LABELS)
            for labels, sample in self.rows:
                value = getattr(sample, attr)
                if value >= 0:
                    family.add_metric(list(labels), value)
            yield family


def render_usage(rows: Sequence[tuple[tuple[str, str, str], _Sample]]) -> bytes:
    """Prometheus text of ``UsageCollector(rows)``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(UsageCollector(rows))
    return generate_latest(registry)
