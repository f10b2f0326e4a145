#!/usr/bin/env python3
"""Templates, in one run; writes bench/results/templates.json.

    .venv/bin/python bench/bench_templates.py [--builds 3] [--sandboxes 5] [--no-cold] [--pss 3]

1. Build time of a pip-only template (three small pure-Python packages) over the built
   ``python`` base, through the REST API (the build VM, layer, manifest, snapshot with the
   preloads), median of ``--builds`` fresh builds, then the same spec again (a cache hit). Where a
   build's time goes, from its log: the build VM's boot (what building in a VM adds, "after"),
   the steps inside it (apt, pip, files, setup, kernel, warm-up, pack: what the host's chroot
   ran "before", now in the VM), the snapshot; and the VM's share of the whole. The reference: a
   cold build of the base from scratch (``guest-image/build.py`` into an empty image dir:
   bootstrap, kernel, erofs, initramfs), which is what a template without layers would cost on
   top of the same layer.
2. Pool-hit create and the first ``1+1`` for that template (as an operator template, whose pool
   /healthz shows) against the built-in ``python``, alternated, ``--sandboxes`` each.
3. PSS of the QEMU process per idle sandbox of each built-in (``--pss`` sandboxes each).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    REPO,
    RESULTS,
    machine_facts,
    now_utc,
    qemu_pss_mib,
    report,
    run_main,
    service,
    summary,
    wait_pool,
)

from kernelhost import AsyncSandbox, AsyncTemplate

PACKAGES = ["tomli-w==1.2.0", "six==1.16.0", "toolz==0.12.1"]
SPEC: dict[str, Any] = {"name": "bench-layer", "pip": PACKAGES, "preload": ["tomli_w", "six", "toolz"]}
OPERATOR_TOML = """name = "bench-pip"
pip = ["tomli-w==1.2.0", "six==1.16.0", "toolz==0.12.1"]
preload = ["tomli_w", "six", "toolz"]
"""
BUILTINS = ("python", "python-datasci", "r")


async def build_times(svc: Any, builds: int, out: dict[str, Any]) -> None:
    auth = {"url": svc.url, "api_key": svc.api_key}
    totals: list[float] = []
    parts: dict[str, list[float]] = {}
    for _ in range(builds):
        spec = {**SPEC, "env": {"BENCH_RUN": str(time.time_ns())}}  # a key no earlier run built
        t0 = time.perf_counter()
        info = await AsyncTemplate.build(spec, **auth)
        totals.append(time.perf_counter() - t0)
        assert info.state == "ready" and info.build is not None, info
        for name, seconds in (await stage_times(svc, info.build.id)).items():
            parts.setdefault(name, []).append(seconds)
    t0 = time.perf_counter()
    again = await AsyncTemplate.build(spec, **auth)
    cached = time.perf_counter() - t0
    assert again.state == "ready", again
    report(out, "pip-only template build (s)", summary(totals),
           "pip-only build over the python base, snapshot included (s)")  # fmt: skip
    for name, samples in parts.items():
        report(out, f"build: {name} (s)", summary(samples), f"of which {name} (s)")
    vm_share = statistics.median(parts["build VM boot"]) / statistics.median(totals)
    report(out, "build VM share", round(vm_share, 2), "the build VM's boot / the whole build (ratio)")
    report(out, "cache hit (s)", round(cached, 2), "the same spec again: a cache hit (s)")
    await AsyncTemplate.delete(SPEC["name"], **auth)


async def stage_times(svc: Any, build_id: str) -> dict[str, float]:
    """Seconds between the build's stages, from its log: the VM's boot (vm -> mount), the steps
    in the VM (mount -> the snapshot stage) and the snapshot (-> the end)."""
    at: dict[str, float] = {}
    async for event in AsyncTemplate.logs(SPEC["name"], build_id, url=svc.url, api_key=svc.api_key):
        if "stage" in event and "error" not in event:
            at.setdefault(str(event["stage"]), float(event["at"]))
        if "state" in event:
            at[str(event["state"])] = float(event["at"])
    return {
        "build VM boot": at["mount"] - at["vm"],
        "steps in the VM": at["snapshot"] - at["mount"],
        "snapshot": at["succeeded"] - at["snapshot"],
    }


def cold_base(out: dict[str, Any]) -> None:
    """The reference: the python base from scratch in an empty image dir."""
    with tempfile.TemporaryDirectory(prefix="kh-bench-cold-") as tmp:
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, str(REPO / "guest-image" / "build.py"), "--image-dir", tmp, "python"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=3600,
        )
        report(
            out,
            "cold base build (s)",
            round(time.perf_counter() - t0, 1),
            "cold build of the base from scratch (s)",
        )


async def first_calls(svc: Any, template: str) -> tuple[float, float]:
    await wait_pool(svc, 1, template, timeout=600)
    t0 = time.perf_counter()
    sbx = await AsyncSandbox.create(template=template, url=svc.url, api_key=svc.api_key)
    created = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        ex = await sbx.run_code("1+1", timeout=120)
        assert ex.text == "2", ex
        return created, time.perf_counter() - t0
    finally:
        await sbx.close()


async def pool_hits(svc: Any, n: int, out: dict[str, Any]) -> None:
    times: dict[str, list[float]] = {}
    for template in ("python", "bench-pip"):  # a template's pool fills once it is first used
        async with AsyncSandbox(template=template, url=svc.url, api_key=svc.api_key) as sbx:
            await sbx.run_code("1+1", timeout=300)
    for _ in range(n):
        for template in ("python", "bench-pip"):  # alternated: the machine's noise hits both
            created, first = await first_calls(svc, template)
            times.setdefault(f"{template} create", []).append(created)
            times.setdefault(f"{template} first 1+1", []).append(first)
    for label, samples in times.items():
        report(out, label, summary(samples), f"{label} (pool hit)")
    for what in ("create", "first 1+1"):
        ratio = out[f"bench-pip {what}"]["median"] / out[f"python {what}"]["median"]
        report(out, f"custom/built-in {what}", round(ratio, 2), f"custom/built-in {what} (ratio)")


async def pss(svc: Any, n: int, out: dict[str, Any]) -> None:
    for template in BUILTINS:
        sbxs = [
            await AsyncSandbox.create(template=template, url=svc.url, api_key=svc.api_key) for _ in range(n)
        ]
        try:
            for sbx in sbxs:
                await sbx.run_code("1+1", timeout=300)
            await asyncio.sleep(5)
            hv = svc.hypervisor()
            try:
                domains = {d.metadata.get("sandbox"): d.name for d in hv.domains()}
            finally:
                hv.close()
            figures = [qemu_pss_mib(domains[s.id]) for s in sbxs]
        finally:
            for sbx in sbxs:
                await sbx.close()
        report(
            out,
            f"{template} PSS (MiB)",
            round(statistics.median(figures), 1),
            f"PSS per idle {template} sandbox, median (MiB)",
        )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sandboxes", type=int, default=5)
    ap.add_argument("--builds", type=int, default=3, help="fresh pip-only builds (median)")
    ap.add_argument("--pss", type=int, default=3)
    ap.add_argument("--no-cold", action="store_true", help="skip the cold base build (minutes)")
    args = ap.parse_args()
    out: dict[str, Any] = {"when": now_utc(), "machine": machine_facts(), "packages": PACKAGES}
    with tempfile.TemporaryDirectory(prefix="kh-bench-templates-") as tmp:
        operator = Path(tmp) / "operator"
        operator.mkdir()
        (operator / "bench-pip.toml").write_text(OPERATOR_TOML)
        env = {"KERNELHOST_POOL_SIZE": "1", "KERNELHOST_TEMPLATE_DIR": str(operator)}
        async with service(Path(tmp), "templates", **env) as svc:
            # the operator's build runs at start; builds queue one at a time, so it goes first
            await AsyncTemplate.wait("bench-pip", url=svc.url, api_key=svc.api_key)
            await build_times(svc, args.builds, out)
            await pool_hits(svc, args.sandboxes, out)
            await pss(svc, args.pss, out)
    if not args.no_cold:
        cold_base(out)
        ratio = out["cold base build (s)"] / out["pip-only template build (s)"]["median"]
        report(out, "cold/layer", round(ratio, 1), "cold base build / pip-only layer build (ratio)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "templates.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    run_main(main)
