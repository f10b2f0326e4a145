"""A template's build VM: the layer of a tenant's template is built inside a throwaway VM booted
from its base image, never on the host (docs/security.md, "The trust boundary").

The host boots the base with one extra, empty, writable raw disk (``DomainSpec.scratch_disk``),
gives the VM an ``allowlist`` network of the host's package indexes only (``BuildIndexes``),
uploads ``guest-image/layer.py`` and ``buildroot.py``, the job (the spec as JSON) and the
tenant's files archive (as bytes, unopened) over the agent channel, and runs ``layer.py`` as a
bash command in the VM: apt, pip, files, setup, the kernel, the warm-up and ``mkfs.erofs`` all
run there. The script writes the layer to the start of the scratch disk and reports its size.
The host destroys the VM, then keeps that many bytes of the disk file as ``layer.erofs`` (under
``template_layer_max_mib``, never mounted or parsed beyond its erofs magic) and reads the
script's report as untrusted JSON (``checked_info``). The VM's memory is reserved against its
key's ``max_memory_mib_per_key`` while it runs; the build's deadline bounds it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from pathlib import Path
from typing import Any

import structlog

from hypervisor import GuestImage, HypervisorError
from hypervisor.ownership import give_to_qemu

from ...channel import AgentClient, ChannelError
from ...channel.protocol import BashFrame, Op
from ..context import Context
from ..network import NetworkSpec, Tunnels
from ..network.indexes import BuildIndexes
from .builds import GUEST_IMAGE, Build, BuildFailed

log = structlog.get_logger("kernelhost.templates")

SCRIPTS = ("layer.py", "buildroot.py")  # uploaded into the VM; part of a layer's key
GUEST_DIR = "/run/kh-build"
CHUNK = 1 << 20  # bytes per upload frame
LINE_MAX = 64 * 1024  # one line of the script's output; longer ones are cut
INFO_MAX = 4 << 20  # the script's final report, as JSON
BOOT_ATTEMPTS = 2  # build VMs started for one build when they fail before its script runs
EROFS_MAGIC = (1024, bytes.fromhex("e2e1f5e0"))  # offset and bytes of an erofs superblock's magic


async def build_in_vm(
    ctx: Context,
    indexes: BuildIndexes,
    build: Build,
    image: GuestImage,
    job: dict[str, Any],
    archive: Path | None,
    scratch: Path,
) -> tuple[dict[str, Any], Path]:
    """Run ``job`` in a build VM of ``image``; (the checked report, the layer file in
    ``scratch``). Raises ``BuildFailed`` naming the stage; whatever ends it, the VM is gone.
    A VM that fails before the build script starts (nothing of the tenant's has run) is
    replaced once: a host's hiccup does not fail the build."""
    settings = ctx.settings
    memory = settings.template_build_memory_mib
    disk = scratch / "layer.disk"
    with ctx.registry.reserve(build.owner, 0, memory):
        for attempt in range(1, BOOT_ATTEMPTS + 1):
            await asyncio.to_thread(_make_disk, disk, settings.template_layer_max_mib)
            domain = ctx.vms.builder_name(f"{build.id.removeprefix('bld_')}-{attempt}")
            try:
                info = await _in_vm(ctx, indexes, build, image, job, archive, disk, domain)
                break
            except _EarlyFailure as exc:
                if attempt == BOOT_ATTEMPTS:
                    raise BuildFailed(str(exc), "vm") from None
                await build.note({"log": f"{exc}; starting another build VM"})
    layer = await asyncio.to_thread(_take_layer, disk, info, settings.template_layer_max_mib)
    return info, layer


class _EarlyFailure(Exception):
    """The build VM failed before the build script started."""


async def _in_vm(
    ctx: Context,
    indexes: BuildIndexes,
    build: Build,
    image: GuestImage,
    job: dict[str, Any],
    archive: Path | None,
    disk: Path,
    domain: str,
) -> dict[str, Any]:
    settings = ctx.settings
    memory = settings.template_build_memory_mib
    agent: AgentClient | None = None
    tunnels: Tunnels | None = None
    started = False
    try:
        what = f"{image.template}, {memory} MiB, network: {indexes.describe()}"
        await build.note({"stage": "vm", "detail": what})
        t0 = time.monotonic()
        meta = {"role": "build", "build": build.id, "key": build.owner}  # "": the operator's
        agent, device = await ctx.vms.boot_builder(domain, image, memory, disk, meta)
        await build.note({"log": f"build VM {domain}: booted in {time.monotonic() - t0:.1f} s"})
        tunnels = Tunnels(indexes.policy(), agent, build.id, count=ctx.metrics.count_connection)
        agent.add_listener(tunnels)
        net = ctx.network.host.guest_config(NetworkSpec("allowlist"))
        await agent.request(Op.NET_CONFIG, timeout=settings.timeouts.net_config, **net)
        job = {**job, "pip_config": indexes.pip, "proxy_env": net["env"]}
        if indexes.cert is not None:
            job["pip_cert"] = f"{GUEST_DIR}/pip-cert.pem"
        await _upload(agent, job, archive, indexes.cert, settings.timeouts.file_op)
        argv = f"--spec {GUEST_DIR}/job.json --out-dev /dev/{device}"
        if archive is not None:
            argv += f" --files {GUEST_DIR}/files.tar.gz"
        started = True
        return await _run(agent, build, f"python3 -u {GUEST_DIR}/layer.py {argv}")
    except (HypervisorError, ChannelError, TimeoutError) as exc:
        # why the VM went (QEMU's log says if it was killed, and by whom), before destroy
        # removes the logs: for the operator's log, not the tenant's (it names host paths)
        log.error("template.build_vm_failed", build=build.id, domain=domain, error=str(exc),
                  evidence=ctx.vms.console_tail(domain, 30, qemu_log=True))  # fmt: skip
        message = f"the build VM failed: {exc or type(exc).__name__}"
        if not started:
            raise _EarlyFailure(message) from None
        raise BuildFailed(message, build.stage) from None
    finally:
        if tunnels is not None:
            tunnels.close()
        if agent is not None:
            await asyncio.shield(agent.close())
        await ctx.vms.destroy(domain)


def _make_disk(path: Path, max_mib: int) -> None:
    """An empty sparse raw disk the build VM's QEMU may write (and nothing else of the host)."""
    with path.open("wb") as f:
        f.truncate(max_mib << 20)
    give_to_qemu(path, 0o600)


async def _upload(
    agent: AgentClient, job: dict[str, Any], archive: Path | None, cert: Path | None, timeout: float
) -> None:
    files: list[tuple[str, bytes | Path]] = [(name, GUEST_IMAGE / name) for name in SCRIPTS]
    files.append(("job.json", json.dumps(job).encode()))
    if cert is not None:
        files.append(("pip-cert.pem", cert))
    if archive is not None:
        files.append(("files.tar.gz", archive))
    for name, source in files:
        data = source if isinstance(source, bytes) else await asyncio.to_thread(source.read_bytes)
        path = f"{GUEST_DIR}/{name}"
        for offset in range(0, max(len(data), 1), CHUNK):
            reply = await agent.request(
                Op.FS_WRITE, timeout=timeout, path=path, offset=offset,
                data=data[offset : offset + CHUNK], create=offset == 0,
            )  # fmt: skip
            if "oserror" in reply:
                raise BuildFailed(f"the build VM could not take {name}: {reply['oserror']!r:.200}", "vm")


async def _run(agent: AgentClient, build: Build, command: str) -> dict[str, Any]:
    """Run the build script; its JSON lines become the build's log. The checked report."""
    run_id = "build" + secrets.token_hex(8)  # alphanumeric, as the agent wants
    lines = _Lines()
    done: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    code: object = None
    with agent.subscribe(run_id) as sub:
        await agent.start_bash(run_id, timeout=30.0, command=command, max_output_bytes=None)
        while True:
            m = await sub.get(timeout=None)  # the build's deadline (BuildQueue) bounds this
            if m.channel == "agent":
                raise BuildFailed(f"the build VM stopped answering: {m.content!r:.200}", build.stage)
            if m.channel == "shell" and m.msg_type == BashFrame.REPLY:
                code = m.content.get("exit_code")
                text = lines.flush()
            elif m.channel == "iopub" and m.msg_type == "stream":
                text = lines.feed(str(m.content.get("text", "")))
            else:
                continue
            for event in text:
                if "done" in event:
                    done = event["done"] if isinstance(event["done"], dict) else None
                    continue
                if "error" in event:
                    failure = event
                await build.note(event)
            if code is not None:
                break
    if failure is not None or code != 0 or done is None:
        message = str(failure["error"]) if failure else f"the build script exited with code {code!r:.20}"
        raise BuildFailed(message[:2000], str((failure or {}).get("stage", build.stage))[:40])
    return checked_info(done)


class _Lines:
    """Output text -> complete lines -> events (JSON objects; anything else is a log line)."""

    def __init__(self) -> None:
        self.partial = ""

    def feed(self, text: str) -> list[dict[str, Any]]:
        *whole, self.partial = (self.partial + text).split("\n")
        if len(self.partial) > INFO_MAX:  # a line that never ends: keep its start as a log line
            whole.append(self.partial[:LINE_MAX])
            self.partial = ""
        return [_event(line) for line in whole if line.strip()]

    def flush(self) -> list[dict[str, Any]]:
        rest, self.partial = self.partial, ""
        return [_event(rest)] if rest.strip() else []


def _event(line: str) -> dict[str, Any]:
    if len(line) > INFO_MAX:
        return {"log": line[:LINE_MAX]}
    try:
        event = json.loads(line)
    except ValueError:
        return {"log": line[:LINE_MAX]}
    if not isinstance(event, dict) or not ({"stage", "log", "error", "done"} & event.keys()):
        return {"log": line[:LINE_MAX]}
    if "done" in event:
        return {"done": event["done"]}
    return {k: _short(event[k]) for k in ("stage", "detail", "log", "error") if k in event}


def _short(value: Any) -> str:
    return str(value)[:LINE_MAX]


def checked_info(info: dict[str, Any]) -> dict[str, Any]:
    """The build script's report, from a VM the tenant controlled: only the expected fields,
    each of the expected type and size."""

    def text(name: str, limit: int = 200) -> str:
        value = info.get(name)
        if not isinstance(value, str) or not 0 < len(value) <= limit:
            raise BuildFailed(f"the build VM's report has no valid {name!r}", "pack")
        return value

    resolved: dict[str, dict[str, str]] = {}
    raw = info.get("resolved") if isinstance(info.get("resolved"), dict) else {}
    for kind in ("apt", "pip"):
        found = raw.get(kind) if isinstance(raw, dict) else None
        pairs = list(found.items())[:20000] if isinstance(found, dict) else []
        resolved[kind] = {str(k)[:200]: str(v)[:200] for k, v in pairs}
    size = info.get("layer_bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise BuildFailed("the build VM's report has no valid layer size", "pack")
    seconds = info.get("build_seconds")
    return {
        "kernel": text("kernel"),
        "language": text("language", 64),
        "display_name": text("display_name"),
        "resolved": resolved,
        "layer_bytes": size,
        "build_seconds": round(float(seconds), 1) if isinstance(seconds, (int, float)) else None,
    }


def _take_layer(disk: Path, info: dict[str, Any], max_mib: int) -> Path:
    """The first ``layer_bytes`` of the scratch disk, kept as ``layer.erofs`` beside it."""
    size = int(info["layer_bytes"])
    if size > max_mib << 20 or size > disk.stat().st_size:
        raise BuildFailed(
            f"the layer is {size} bytes, over template_layer_max_mib ({max_mib} MiB); "
            "install less, or ask the operator to raise the setting",
            "pack",
        )
    with disk.open("r+b") as f:
        f.seek(EROFS_MAGIC[0])
        if f.read(len(EROFS_MAGIC[1])) != EROFS_MAGIC[1]:
            raise BuildFailed("the build VM wrote no erofs layer", "pack")
        f.truncate(size)
    layer = disk.with_name("layer.erofs")  # root's again in stages._install
    disk.rename(layer)
    return layer
