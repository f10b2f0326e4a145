"""Helpers shared by the benchmarks under bench/: statistics, printing, machine facts, memory
figures, the kernelhost service, a local ipykernel driven by jupyter_client, and the workloads.

Every benchmark measures its reference in the same run, prints each figure as soon as it has it
(an interrupted run still shows what it measured) and writes JSON under bench/results/.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from jupyter_client.manager import AsyncKernelManager  # noqa: E402

from tests.harness import Service as Service  # noqa: E402  (re-exported: the benchmarks import it from here)

# -- statistics and printing ---------------------------------------------------------------------


def summary(samples: list[float]) -> dict[str, float]:
    """Median, p95 (nearest rank), min, max and count of some samples."""
    s = sorted(samples)
    return {
        "median": statistics.median(s),
        "p95": s[min(len(s) - 1, round(0.95 * (len(s) - 1)))],
        "min": s[0],
        "max": s[-1],
        "n": len(s),
    }


def percentile(samples: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of some samples, by nearest rank."""
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def spin_code(seconds: float) -> str:
    """A cell that keeps its vCPU busy for ``seconds``."""
    return f"import time\nt = time.time()\nwhile time.time() - t < {seconds}:\n    pass"


def ms(fig: dict[str, float]) -> str:
    return f"{fig['median'] * 1000:9.1f} ms {fig['p95'] * 1000:9.1f} ms  n={fig['n']}"


def report(out: dict[str, Any], key: str, value: Any, label: str | None = None) -> None:
    """Store a figure and print it at once, so an interrupted run still shows what it measured.
    Dicts with a median are durations in seconds and print as ``median p95`` in ms."""
    out[key] = value
    name = label or key
    if isinstance(value, dict) and "median" in value:
        print(f"  {name:44} {ms(value)}", flush=True)
    else:
        print(f"  {name:44} {value}", flush=True)


def now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# -- machine facts and memory --------------------------------------------------------------------


def _meminfo(field: str) -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/meminfo")


def mem_available_mib() -> float:
    return _meminfo("MemAvailable")


def machine_facts() -> dict[str, Any]:
    model = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "host": platform.node(),
        "arch": platform.machine(),
        "cpu_model": model,
        "cores": os.cpu_count(),
        "mem_total_mib": round(_meminfo("MemTotal")),
        "mem_available_mib_at_start": round(mem_available_mib()),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
        "python": platform.python_version(),
    }


def smaps_mib(pid: int, field: str = "Pss") -> float:
    """A field of ``/proc/PID/smaps_rollup`` (``Pss``, ``Rss``) in MiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} line for pid {pid}")


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc, no psutil needed)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                kids.append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            out.append(kid)
            todo.append(kid)
    return out


def qemu_pid(domain: str) -> int:
    return int(Path(f"/run/libvirt/qemu/{domain}.pid").read_text())


def qemu_pss_mib(domain: str) -> float:
    return smaps_mib(qemu_pid(domain))


# -- the kernelhost service ----------------------------------------------------------------------


def domains_of(svc: Service) -> list[str]:
    """Running sandbox domains (and pooled clones) of a service, templates excluded."""
    hv = svc.hypervisor()
    try:
        return [d.name for d in hv.domains() if d.running and d.metadata.get("role") != "template"]
    finally:
        hv.close()


@contextlib.asynccontextmanager
async def service(tmp: Path, name: str, **env: str) -> AsyncIterator[Service]:
    """A started ``kernelhost serve`` of its own (prefix, state, port); on exit, also on error or
    Ctrl-C, it is stopped and every domain of its prefix destroyed."""
    d = tmp / name
    d.mkdir(parents=True, exist_ok=True)
    svc = Service.make(d, **env)
    # the acceleration probe's verdict (cached per host kernel, QEMU and libvirt version) is
    # shared between the run's services, so only the first one probes
    cached = tmp / "accel.json"
    if cached.is_file():
        shutil.copy(cached, d / "accel.json")
    try:
        await asyncio.to_thread(svc.start, 120.0)
        if (d / "accel.json").is_file():
            shutil.copy(d / "accel.json", cached)
        yield svc
    finally:
        leaked, _ = await asyncio.shield(asyncio.to_thread(svc.cleanup))
        logs = REPO / "results"
        logs.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy(svc.log_path, logs / f"bench-{name}-service.log")
        if leaked:
            print(f"  (cleaned up domains left running by {name}: {len(leaked)})", flush=True)


async def healthz(svc: Service) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http, http.get(f"{svc.url}/healthz") as r:
        return dict(await r.json())


async def pool_ready(svc: Service, template: str = "python") -> int:
    return int((await healthz(svc))["pool"].get(template, 0))


async def wait_pool(svc: Service, want: int, template: str = "python", timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while await pool_ready(svc, template) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"pool did not reach {want} within {timeout}s")
        await asyncio.sleep(0.1)


# -- workloads -----------------------------------------------------------------------------------


def print_code(mib: int) -> str:
    """A cell writing ``mib`` MiB to stdout as fast as it can, in 1 KiB lines."""
    return (
        "import sys\n"
        "line = 'x' * 1023 + '\\n'\n"
        f"for _ in range({mib} * 1024):\n"
        "    sys.stdout.write(line)\n"
        "sys.stdout.flush()\n"
    )


def bash_code(mib: int) -> str:
    return f"head -c {mib * 1024 * 1024} /dev/zero | tr '\\0' x"


CSV_HEADER = "id,category,value,qty\n"


def make_csv(path: Path, target_mb: float = 50.0, seed: int = 7) -> int:
    """Write a deterministic CSV of about ``target_mb`` MB (id, category of 200, float, int);
    returns its size in bytes. The same bytes feed every system's pandas workload."""
    rng = random.Random(seed)
    target = int(target_mb * 1e6)
    size = 0
    with path.open("w") as f:
        f.write(CSV_HEADER)
        size += len(CSV_HEADER)
        i = 0
        while size < target:
            rows = "".join(
                f"{i + k},cat_{rng.randrange(200):03d},{rng.random() * 1000:.6f},{rng.randrange(100)}\n"
                for k in range(10_000)
            )
            i += 10_000
            f.write(rows)
            size += len(rows)
    return path.stat().st_size


def pandas_code(path: str) -> str:
    """Load the CSV and group by category; the value is a checksum comparable across systems."""
    # in a function, so a run's frame is freed before the next one reads the file again (two
    # 50 MB frames at once do not fit a 512 MiB sandbox next to the file itself)
    return (
        "import pandas as pd\n"
        "def _bench_pandas():\n"
        f"    df = pd.read_csv({path!r}, dtype={{'category': 'category'}})\n"
        "    g = df.groupby('category', observed=True).agg(v=('value', 'mean'), "
        "q=('qty', 'sum'))\n"
        "    return (len(df), len(g), int(g['q'].sum()))\n"
        "_bench_pandas()\n"
    )


# -- a kernel as every system offers it ----------------------------------------------------------


@dataclass
class Answer:
    status: str
    text: str | None  # text/plain of the main result
    stdout_chars: int


class Kernel:
    """What the suite needs of a kernel on any system."""

    name = "kernel"

    async def execute(self, code: str, timeout: float = 600) -> Answer:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


class LocalKernel(Kernel):
    """An ipykernel on this host, driven by jupyter_client (the reference)."""

    name = "local"

    def __init__(self) -> None:
        self.km = AsyncKernelManager(kernel_name="python3")
        self.kc: Any = None

    @classmethod
    async def start(cls) -> LocalKernel:
        k = cls()
        try:
            # its stderr (ipykernel's warnings) would interleave with the figures
            await k.km.start_kernel(stderr=subprocess.DEVNULL)
            k.kc = k.km.client()
            k.kc.start_channels()
            await k.kc.wait_for_ready(timeout=60)
        except BaseException:
            await k.close()
            raise
        return k

    @property
    def pid(self) -> int:
        return int(self.km.provisioner.process.pid)  # type: ignore[union-attr]

    async def execute(self, code: str, timeout: float = 600) -> Answer:
        chars = 0
        text: str | None = None

        def hook(msg: dict[str, Any]) -> None:
            nonlocal chars, text
            t = msg["header"]["msg_type"]
            if t == "stream":
                chars += len(msg["content"]["text"])
            elif t == "execute_result":
                text = msg["content"]["data"].get("text/plain")

        reply = await self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        return Answer(reply["content"]["status"], text, chars)

    async def close(self) -> None:
        if self.kc is not None:
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            if self.km.has_kernel:
                await self.km.shutdown_kernel(now=True)


async def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = await fn()
    return time.perf_counter() - t0, value


def run_main(main: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """``asyncio.run(main())`` that stops what the run started on SIGTERM too, as on Ctrl-C: the
    signal cancels the main task, so every ``service`` context stops its service and destroys
    its domains (a benchmark killed by SIGTERM had left 52 VMs running)."""

    async def guarded() -> None:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
        await main()

    try:
        asyncio.run(guarded())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: what this run started has been stopped", file=sys.stderr)
        sys.exit(130)
