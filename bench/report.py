#!/usr/bin/env python3
"""Render bench/results/bench.json (written by bench/run.py) as a Markdown table, and rewrite the
README's Performance block (between ``<!-- bench:start -->`` and ``<!-- bench:end -->``).

    .venv/bin/python bench/report.py [bench/results/bench.json] [--update-readme]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
SYSTEMS = ("kernelhost", "local", "gateway")
HEADERS = {
    "kernelhost": "kernelhost",
    "local": "local ipykernel (jupyter_client)",
    "gateway": "jupyter-kernel-gateway",
}


def _dur(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"
    if s >= 0.01:
        return f"{s * 1000:.0f} ms"
    return f"{s * 1000:.1f} ms"


def _ratio(value: float, ref: float | None) -> str:
    if not ref:
        return ""
    x = value / ref
    return f" · {x:.1f}x" if x < 100 else f" · {x:.0f}x"


def _time_cell(sys_: dict[str, Any], key: str, ref: dict[str, Any] | None) -> str:
    fig = sys_.get(key)
    if not isinstance(fig, dict):
        return "—"
    cell = f"{_dur(fig['median'])} (p95 {_dur(fig['p95'])})"
    if ref is not None and ref is not sys_ and isinstance(ref.get(key), dict):
        cell += _ratio(fig["median"], ref[key]["median"])
    return cell


def _short(reason: str, limit: int = 110) -> str:
    """First line of the acceleration probe's reason, cut to fit a table caption."""
    line = reason.splitlines()[0].strip()
    line = re.sub(r"domain '[^']*'", "the probe domain", line)
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


def render(res: dict[str, Any]) -> str:
    s = res["systems"]
    local = s.get("local")
    cols = [name for name in SYSTEMS if name in s]
    m = res["machine"]
    kh = s.get("kernelhost", {})
    accel = (kh.get("accel") or "n/a").upper()
    r = res["rounds"]
    lines = [
        f"Measured {res['when']} by `make bench` (`bench/run.py`, {res['mode']} run: "
        f"{r['start']} starts, {r['roundtrip']} round trips, {r['stream']} x {r['stream_mib']} MiB "
        f"streams, {r['pandas']} pandas runs per system; whole run {res.get('took_s', 0):.0f} s) "
        f"on {m['cores']} cores ({m['cpu_model']}), {m['mem_total_mib'] / 1024:.0f} GiB RAM, "
        f"load {m['load_avg_at_start'][0]} at start. **kernelhost VMs ran under "
        f"{accel}** ({_short(kh.get('accel_reason') or 'no kernelhost figures')}). Median (p95); "
        "`· Nx` is the ratio to the local ipykernel's median.",
        "",
        "| figure | " + " | ".join(HEADERS[c] for c in cols) + " |",
        "| --- | " + " | ".join("---" for _ in cols) + " |",
    ]

    def row(label: str, cells: dict[str, str]) -> None:
        lines.append(f"| {label} | " + " | ".join(cells.get(c, "—") for c in cols) + " |")

    def start(sys_: dict[str, Any], key: str, what: str) -> str:
        cell = _time_cell(sys_, key, local)
        if cell == "—":
            return cell
        req = sys_.get(key.replace("_s", "_request_s"))
        extra = f", request answered in {_dur(req['median'])}" if isinstance(req, dict) else ""
        return f"{cell}: {what}{extra}"

    row(
        "usable kernel, cold boot (to `1+1` answered)",
        {"kernelhost": start(kh, "start_boot_s", "VM boot, snapshots off")},
    )
    row(
        "usable kernel, cold (to `1+1` answered)",
        {
            c: start(
                s[c],
                "start_cold_s",
                {
                    "kernelhost": "snapshot restore (pool miss)",
                    "local": "new kernel process",
                    "gateway": "POST /api/kernels",
                }[c],
            )
            for c in cols
        },
    )
    row(
        "usable kernel, warm (to `1+1` answered)",
        {"kernelhost": start(kh, "start_warm_s", "pool hit"), "local": "no pool", "gateway": "no pool"},
    )
    row("`1+1` round trip", {c: _time_cell(s[c], "roundtrip_s", local) for c in cols})

    def mbs(c: str) -> str:
        fig = s[c].get("stdout_mb_s")
        if not fig:
            return "—"
        cell = f"{fig['median']:.1f} MB/s"
        if local and c != "local" and local.get("stdout_mb_s"):
            cell += _ratio(fig["median"], local["stdout_mb_s"]["median"])
        return cell

    row("streamed stdout (`print` loop)", {c: mbs(c) for c in cols})
    mb = res.get("csv_bytes", 0) / 1e6

    def pandas(c: str) -> str:
        cell = _time_cell(s[c], "pandas_s", local)
        if "pandas_version" in s[c]:
            cell += f" (pandas {s[c]['pandas_version']})"
        return cell

    row(f"pandas: read a {mb:.0f} MB CSV + group-by", {c: pandas(c) for c in cols})
    if "csv_upload_s" in kh:
        row(
            f"upload the {mb:.0f} MB CSV (files API)",
            {
                "kernelhost": f"{kh['csv_upload_s']:.1f} s",
                "local": "— (local file)",
                "gateway": "— (local file)",
            },
        )
    row(
        "fork(1), to `1+1` in the child",
        {"kernelhost": _time_cell(kh, "fork1_s", None), "local": "not supported", "gateway": "not supported"},
    )

    def mem(c: str) -> str:
        m_ = s[c].get("idle_memory")
        if not m_:
            return "—"
        cell = f"{m_['pss_mib']['median']:.0f} MiB PSS ({m_['kernels']} idle)"
        if c == "gateway" and "server_pss_mib" in s[c]:
            cell += f" + {s[c]['server_pss_mib']:.0f} MiB server"
        return cell

    row("memory per idle kernel", {c: mem(c) for c in cols})

    def fit(c: str) -> str:
        m_ = s[c].get("idle_memory")
        if not m_:
            return "—"
        cell = f"~{m_['fit_estimate']} (estimate: {m_['mem_available_mib'] / 1024:.1f} GiB available / PSS)"
        d = s[c].get("density_measured")
        if d:
            cell += (
                f"; measured earlier: {d['answered']} answering in {d['host_mem_used_mib'] / 1024:.1f} GiB"
            )
        return cell

    row("idle kernels that fit in this machine", {c: fit(c) for c in cols})
    if "gateway" in s and "version" in s["gateway"]:
        lines += [
            "",
            f"jupyter-kernel-gateway {s['gateway']['version']}: local kernels, driven over "
            "REST and the kernel WebSocket with aiohttp, its IOPub rate limit off (by "
            "default it drops stream output over 1 MB/s). About 40 ms of its `1+1` is a "
            "stall on that WebSocket: status busy arrives after ~6 ms, everything else "
            "~40 ms later, the mark of Nagle's algorithm meeting delayed ACKs (jupyter_server "
            "never sets TCP_NODELAY on it). The pandas CSV is written on the host "
            "once and read by every system (kernelhost: uploaded into a `python-datasci` "
            "sandbox through the files API). Memory: PSS of each idle kernel's process "
            '(kernelhost: its QEMU), with several idle side by side; "fit" divides '
            "MemAvailable by it.",
        ]
    return "\n".join(lines) + "\n"


def update_readme(md: str, readme: Path = README) -> None:
    text = readme.read_text()
    block = f"{START}\n{md}{END}"
    if START in text and END in text:
        text = re.sub(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        raise SystemExit(f"{readme} has no {START} ... {END} block in its Performance section")
    readme.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("json", nargs="?", type=Path, default=REPO / "bench/results/bench.json")
    parser.add_argument("--update-readme", action="store_true")
    args = parser.parse_args()
    md = render(json.loads(args.json.read_text()))
    print(md)
    if args.update_readme:
        update_readme(md)


if __name__ == "__main__":
    main()
