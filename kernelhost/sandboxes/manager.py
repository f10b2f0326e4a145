"""``SandboxManager``: the sandbox layer's public API, used by the REST routes, the Kernel Gateway,
the MCP server and every later interface. It holds no logic of its own beyond checking a call's
input and running executions; each capability lives in its own module (docs/architecture.md):

- ``registry``: the sandboxes and their records, per-key limits;
- ``lifecycle``: create, bind to a channel, lose, remove, reconcile at start;
- ``hibernation``: hibernate, wake, and the idle reaper;
- ``recovery``: interrupt, restart, VM replacement;
- ``fork``; ``checkpoints`` (checkpoint, restore, undo, branch); ``files``; ``network``;
  ``contexts`` (kernels of their own beside the main one); ``session`` (co-attached clients);
- ``execution``: one call on the kernel or in bash, and the timeout ladder.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import structlog

from hypervisor import Hypervisor, HypervisorError, ImageStore

from .. import tracing
from ..channel import ChannelError
from ..config import Settings
from ..metrics import Metrics
from ..tasks import TaskSet
from .access import channel_key, kept_hashes, load_token_key, new_access_token, token_matches, tokens_of
from .checkpoints.service import Checkpoints
from .cluster import Location, Membership, Node, Placement
from .context import Context
from .errors import InvalidRequest
from .execution import Cell, CellPolicy, End, Event, OutputLimits, RunningCall, run_cell
from .inside import CodeContexts, FileService, Ports, Processes, UsageMeter
from .lifecycle.create import Lifecycle
from .lifecycle.fork import Forker
from .lifecycle.hibernation import Hibernation, Reaper
from .lifecycle.recovery import Recoverer
from .network import HostNetwork, NetworkSpec, SandboxNetwork
from .registry import Quota, Registry
from .sampler import UsageSampler
from .sandbox import Sandbox, ensure_usable, wait_replacement
from .session import Sessions
from .states import Recovery
from .store.checkpoints import CheckpointRecord, CheckpointStore
from .store.sandboxes import SandboxRecord, Store
from .store.templates import TemplateStore
from .templates import TemplateSpec
from .templates.builds import Build
from .templates.service import OperatorTemplates, TemplateService
from .templates.views import TemplateView
from .vm.backend import VmBackend
from .vm.factory import VmFactory
from .vm.pool import WarmPool

log = structlog.get_logger("kernelhost.sandboxes")


class SandboxManager:
    def __init__(
        self,
        settings: Settings,
        hv: Hypervisor,
        images: ImageStore,
        store: Store,
        accel: str,
        host_network: HostNetwork | None = None,
        backend: VmBackend | None = None,
    ) -> None:
        self.settings = settings
        self.accel = accel
        self.metrics = Metrics()  # scraped at GET /metrics
        self.host_network = host_network or HostNetwork(settings)
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        self._token_key = load_token_key(settings.state_dir, settings.cluster_secret)
        registry = Registry(
            store,
            Quota(
                settings.max_sandboxes_per_key,
                settings.max_memory_mib_per_key,
                settings.create_queue_seconds,
                settings.create_queue_length,
            ),
        )
        self._ctx = ctx = Context(
            settings=settings,
            images=images,
            registry=registry,
            vms=backend
            if backend is not None
            else VmFactory(settings, hv, images, accel, channel_key(self._token_key)),
            metrics=self.metrics,
            network=SandboxNetwork(settings, self.host_network, self.metrics),
            tasks=TaskSet("sandboxes"),
            accel=accel,
        )
        self._templates = TemplateService(ctx, TemplateStore(store.db, store.node))
        self._lifecycle = Lifecycle(ctx, self._templates.resolve)
        self._hibernation = Hibernation(ctx, self._lifecycle)
        self._reaper = Reaper(ctx, self._lifecycle, self._hibernation)
        self._recovery = Recoverer(ctx, self._lifecycle, self._hibernation)
        self._forker = Forker(ctx, self._lifecycle, self._hibernation)
        self._checkpoints = Checkpoints(
            ctx, self._lifecycle, CheckpointStore(store.db), self._recovery.swap_vm
        )
        self.files = FileService(settings, self._hibernation.wait_for_vm)
        self.contexts = CodeContexts(settings, self._hibernation.wait_for_vm)
        self.ports = Ports(ctx, self._hibernation.wait_for_vm)
        self.sessions = Sessions(
            registry, self._hibernation.ensure_awake, send_timeout=settings.agent_timeout, tasks=ctx.tasks
        )
        self._policy = CellPolicy(
            OutputLimits(settings.max_output_bytes, settings.max_result_bytes),
            interrupt_grace=settings.interrupt_grace,
            restart_timeout=settings.restart_timeout,
            agent_timeout=settings.agent_timeout,
        )
        self.processes = Processes(ctx, self._policy, self._hibernation.wait_for_vm)
        self.usage = UsageMeter(ctx, self.processes)
        self.sampler = UsageSampler(ctx)  # each running sandbox's usage over time
        self._background: list[asyncio.Task[Any]] = []
        # a node of a cluster: its store is shared (docs/cluster.md)
        self.cluster = Membership(ctx, store) if store.shared else None

    # -- start-up and shutdown -----------------------------------------------------------------

    async def start(self) -> None:
        """Reattach to running VMs, destroy strays, start the reaper and the warm pools."""
        await self._ctx.vms.prepare()
        if self.cluster is not None:
            await self.cluster.start()  # before the reconcile: what the cluster gave up goes
        await self._lifecycle.reconcile()
        self._checkpoints.start()
        await asyncio.to_thread(self._templates.start)
        tasks = self._ctx.tasks
        self._background = [
            tasks.spawn(self._reaper.run(), name="idle-reaper"),
            tasks.spawn(self._warm_up(), name="warm-up"),
            tasks.spawn(OperatorTemplates(self._templates).load(), name="operator-templates"),
        ]
        if self.sampler.enabled:
            self._background.append(tasks.spawn(self.sampler.run(), name="usage-sampler"))

    async def _warm_up(self) -> None:
        """Build missing template snapshots, then keep each template's pool filled."""
        vms, images = self._ctx.vms, self._ctx.images
        if not vms.use_snapshots:
            return
        for template in self.templates():  # the shared ones; a key's own fill once it is used
            try:
                await vms.warm(images.get(template))
            except (HypervisorError, ChannelError, TimeoutError) as exc:
                log.error("snapshot.build_failed", template=template, error=str(exc))

    async def close(self) -> None:
        """Stop background work and close channels; VMs keep running for the next start."""
        ctx = self._ctx
        await ctx.tasks.close(timeout=ctx.settings.timeouts.cleanup)
        if self.cluster is not None:
            self.cluster.close()
        await ctx.vms.close()
        self._checkpoints.close()
        for sbx in ctx.registry:
            if sbx.agent is not None:
                await sbx.agent.close()
        await ctx.vms.retry_destroys()
        self.host_network.close()

    # -- lookups -------------------------------------------------------------------------------

    def get(self, owner: str, sandbox_id: str) -> Sandbox:
        """The caller's sandbox; ``SandboxNotFound`` for an unknown one or another key's."""
        return self._ctx.registry.get(owner, sandbox_id)

    def find(self, sandbox_id: str) -> Sandbox | None:
        """Any key's sandbox by id: for interfaces that check a per-sandbox credential
        themselves (the E2B surface's access tokens), never to answer a caller directly."""
        return self._ctx.registry.find(sandbox_id)

    def owned(self, owner: str) -> list[Sandbox]:
        return self._ctx.registry.owned(owner)

    def all(self) -> list[Sandbox]:
        return list(self._ctx.registry)

    # -- the cluster (docs/cluster.md) ------------------------------------------------------------

    def locate(self, sandbox_id: str) -> Location | None:
        """Where a sandbox of any node is (None: no such sandbox); only on a cluster node."""
        return self.cluster.locate(sandbox_id) if self.cluster is not None else None

    def place(self, owner: str, template: str, count: int = 1) -> Placement | None:
        """Choose the node for a create of ``owner``'s ``template`` and reserve room there
        (None: this service is not a cluster node)."""
        if self.cluster is None:
            return None
        name, image = self._templates.resolve(owner, template)
        return self.cluster.place(owner, name, count, self._ctx.shape_for(image).memory_mib)

    def release_placement(self, placement: Placement) -> None:
        """Give back the room ``place`` reserved (idempotent: the create that used it released it)."""
        if self.cluster is not None:
            self.cluster.release(placement)

    def cluster_nodes(self) -> list[Node]:
        """Every node of the cluster, as the store has them (empty: not a cluster node)."""
        return self.cluster.all_nodes() if self.cluster is not None else []

    def wake_node(self, loc: Location) -> Node | None:
        """The node a movable sandbox (hibernated on a dead or draining node) should wake on."""
        return self.cluster.wake_node(loc) if self.cluster is not None else None

    def take_over(self, loc: Location) -> Sandbox | None:
        """Adopt a hibernated sandbox of a dead or draining node (it wakes here on its next call)."""
        return self.cluster.take_over(loc) if self.cluster is not None else None

    async def drain(self) -> int:
        """Take no new sandboxes here and hibernate the running ones, so they wake elsewhere;
        returns how many were hibernated."""
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.set_draining, self.cluster.id, True)
        count = 0
        for sbx in self.all():
            if sbx.live_agent is not None:
                with contextlib.suppress(Exception):
                    await self.hibernate(sbx)
                    count += 1
        log.info("node.drained", hibernated=count)
        return count

    def templates(self) -> list[str]:
        """The templates every key may use that are ready: built-ins and the operator's."""
        return [v.name for v in self._templates.visible("") if v.state == "ready"]

    # -- templates -------------------------------------------------------------------------------

    def template_health(self) -> dict[str, object]:
        """Templates by state for /healthz and doctor (names of keys' own templates withheld)."""
        return self._templates.health()

    def template_list(self, owner: str) -> list[TemplateView]:
        """The templates ``owner`` may use: its own, the operator's, the built-ins."""
        return self._templates.visible(owner)

    def template(self, owner: str, name: str) -> TemplateView:
        return self._templates.view(owner, name)

    def template_builds(self, owner: str, name: str) -> list[dict[str, Any]]:
        return self._templates.builds_of(owner, name)

    def template_spec(self, data: Any) -> TemplateSpec:
        """A template spec as a request gives it (a JSON object), checked into a ``TemplateSpec``:
        every field, and its base and name against this service's built-in templates."""
        return self._templates.parse(data)

    async def build_template(self, owner: str, spec: TemplateSpec, archive: bytes | None = None) -> Build:
        """Build ``spec`` (``template_spec``'s) off the request path; the build (a cache hit is one
        too)."""
        return await self._templates.submit(owner, spec, archive)

    def template_build(self, owner: str, name: str, build_id: str | None = None) -> Build:
        return self._templates.build(owner, name, build_id)

    def follow_build(self, build: Build, follow: bool = True) -> AsyncIterator[dict[str, Any]]:
        """The build's log events so far, then (``follow``) live until it ends."""
        return self._templates.queue.follow(build, follow)

    async def cancel_template_build(self, owner: str, name: str, build_id: str | None = None) -> Build:
        return await self._templates.cancel(owner, name, build_id)

    async def delete_template(self, owner: str, name: str) -> None:
        await self._templates.delete(owner, name)

    @property
    def pool(self) -> WarmPool:
        return self._ctx.vms.pool

    def check_usable(self, sbx: Sandbox) -> None:
        """Raise ``SandboxNotRunning`` for a dead sandbox (before, say, a WebSocket upgrade)."""
        ensure_usable(sbx)

    # -- lifecycle -------------------------------------------------------------------------------

    async def create(
        self,
        owner: str,
        template: str,
        idle_timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        network: NetworkSpec | None = None,
        auto_checkpoint: int = 0,
        checkpoint: str | None = None,
        run_as: str = "",
    ) -> Sandbox:
        """A new sandbox of ``template``, or (``checkpoint``) holding a checkpoint's state.
        ``network``: ``parse_network``'s (None: the template's default); ``auto_checkpoint``:
        how many calls ``undo`` reaches (``parse_auto_checkpoint``'s; 0: none); ``run_as``: the
        account of the image its code runs as ("": root; inside/accounts.py)."""
        if checkpoint is None:
            keep, user = auto_checkpoint, run_as
            return await self._lifecycle.create(owner, template, idle_timeout, metadata, network, keep, user)
        idle = self._lifecycle.idle_timeout(idle_timeout)
        meta = self._lifecycle.check_metadata(metadata)
        sbx = await self._checkpoints.branch(owner, checkpoint, idle, meta)
        if auto_checkpoint:
            self._ctx.registry.update(sbx, auto_checkpoint=auto_checkpoint)
        return sbx

    async def branch(
        self,
        owner: str,
        checkpoint: str,
        idle_timeout: int | None = None,
        metadata: dict[str, str] | None = None,
        network: NetworkSpec | None = None,
    ) -> Sandbox:
        """A new sandbox holding the state of one of ``owner``'s checkpoints (its sandbox may be
        gone, for a kept one), in ``network`` or (None) the mode its sandbox had."""
        idle = self._lifecycle.idle_timeout(idle_timeout)
        meta = self._lifecycle.check_metadata(metadata)
        return await self._checkpoints.branch(owner, checkpoint, idle, meta, network)

    async def delete(self, owner: str, sandbox_id: str) -> None:
        await self._lifecycle.delete(owner, sandbox_id)

    async def hibernate(self, sbx: Sandbox) -> None:
        await self._hibernation.hibernate(sbx)

    async def wake(self, sbx: Sandbox) -> None:
        """Wake a hibernated sandbox now (any call would; this one does nothing else)."""
        ensure_usable(sbx)
        await self._hibernation.ensure_awake(sbx, asked=True)

    def set_idle_timeout(self, sbx: Sandbox, seconds: int) -> None:
        """A new idle timeout, counted from now."""
        idle = self._lifecycle.idle_timeout(seconds)
        self._ctx.registry.update(sbx, idle_timeout_seconds=idle)
        self._ctx.registry.touch(sbx)

    def set_idle_action(self, sbx: Sandbox, action: str | None, wake_on_call: bool = True) -> None:
        """What ``sbx``'s idle timeout does: ``hibernate`` or ``delete`` (None: the service's
        ``idle_action``); and whether a call wakes it once hibernated (False: only ``wake``)."""
        if action not in (None, "hibernate", "delete"):
            raise InvalidRequest(f"idle action {action!r}: use hibernate or delete", field="idle_action")
        self._ctx.registry.update(sbx, idle_action=action or "", wake_on_call=int(wake_on_call))

    async def expire(self, sbx: Sandbox) -> None:
        """``sbx``'s idle timeout reached now: hibernated or deleted as its idle action says."""
        await asyncio.shield(self._reaper.expire(sbx))

    async def fork(self, owner: str, sandbox_id: str, n: int = 1) -> list[Sandbox]:
        return await self._forker.fork(owner, sandbox_id, n)

    # -- access tokens (access.py: per-sandbox credentials, kept as hashes) ----------------------

    def mint_access_token(self, sbx: Sandbox) -> str:
        """A new access token of ``sbx``, stored as its hash; the earlier ones stay valid (but
        the oldest past ``MAX_ACCESS_TOKENS``)."""
        token, kept = new_access_token(self._token_key, sbx.id)
        self._ctx.registry.update(sbx, access_tokens=kept_hashes(sbx.record.access_tokens, kept))
        return token

    def find_by_token(self, matches: Callable[[str], bool]) -> Sandbox | None:
        """The sandbox of this node one of whose access tokens ``matches`` accepts (E2B's signed
        URLs name no sandbox: one of its tokens made the signature). Every token is tried, so
        the time taken does not say which matched."""
        found = None
        for sbx in self._ctx.registry:
            for token in tokens_of(self._token_key, sbx.id, sbx.record.access_tokens):
                if matches(token) and found is None:
                    found = sbx
        return found

    @staticmethod
    def access_token_valid(rec: SandboxRecord | None, presented: str) -> bool:
        """Whether ``presented`` is one of the access tokens of the sandbox of ``rec`` (a record
        of any node: a cluster node checks before it forwards). None (no such sandbox) takes
        the same time and is False."""
        return token_matches([] if rec is None else rec.access_tokens, presented)

    # -- checkpoints -----------------------------------------------------------------------------

    async def checkpoint(self, sbx: Sandbox, label: str | None = None) -> CheckpointRecord:
        return await self._checkpoints.checkpoint(sbx, label)

    def checkpoints(self, sbx: Sandbox) -> list[CheckpointRecord]:
        return self._checkpoints.of(sbx)

    async def checkpoint_kept(self, sbx: Sandbox, label: str | None = None) -> CheckpointRecord:
        """A checkpoint that outlives its sandbox: only deleting it ends it (it counts against
        ``max_checkpoint_bytes_per_key`` until then)."""
        return await self._checkpoints.checkpoint(sbx, label, keep=True)

    def get_checkpoint(self, owner: str, checkpoint_id: str) -> CheckpointRecord:
        return self._checkpoints.get(owner, checkpoint_id)

    def owner_checkpoints(self, owner: str, kept_only: bool = False) -> list[CheckpointRecord]:
        """All of ``owner``'s checkpoints, oldest first, with the kept ones of sandboxes that are
        gone (``kept_only``: just the kept ones)."""
        return self._checkpoints.of_owner(owner, kept_only=kept_only)

    def discard_checkpoint(self, owner: str, checkpoint_id: str) -> CheckpointRecord:
        """Delete one of ``owner``'s checkpoints by id, whether its sandbox runs or not."""
        return self._checkpoints.discard(owner, checkpoint_id)

    async def delete_checkpoint(self, sbx: Sandbox, checkpoint_id: str) -> None:
        await self._checkpoints.delete(sbx, checkpoint_id)

    async def restore(self, sbx: Sandbox, checkpoint_id: str) -> CheckpointRecord:
        return await self._checkpoints.restore(sbx, checkpoint_id)

    async def undo(self, sbx: Sandbox, n: int = 1) -> CheckpointRecord:
        return await self._checkpoints.undo(sbx, n)

    async def interrupt(self, sbx: Sandbox) -> bool:
        return await self._recovery.interrupt(sbx)

    async def restart(self, sbx: Sandbox, announce: bool = True) -> Recovery:
        """Restart the kernel (a dead or silent VM is replaced). ``announce=False``: the
        attached Jupyter clients asked for it and reconnect by themselves, so they are not sent
        a ``restarting`` status."""
        kernel = sbx.kernel
        if kernel is None or announce:
            return await self._recovery.restart(sbx)
        kernel.quiet_restart = True
        try:
            return await self._recovery.restart(sbx)
        finally:
            kernel.quiet_restart = False

    # -- execution -------------------------------------------------------------------------------

    async def execute(
        self,
        sbx: Sandbox,
        code: str,
        language: str = "python",
        timeout: float | None = None,
        context: str | None = None,
    ) -> AsyncGenerator[Event, None]:
        """Events of one execution; calls to one sandbox run one at a time, in arrival order.
        ``context``: the code context whose kernel runs it (``contexts``), not the main one."""
        s = self.settings
        cell = Cell.checked(
            code,
            language,
            timeout,
            max_bytes=s.max_code_bytes,
            default_timeout=s.default_execution_timeout,
            context=context,
        )
        ensure_usable(sbx)
        return self._execute(sbx, cell)

    async def _execute(self, sbx: Sandbox, cell: Cell) -> AsyncGenerator[Event, None]:
        registry = self._ctx.registry
        async with sbx.lock.hold("execute"):
            await wait_replacement(sbx)
            ensure_usable(sbx)
            await self._hibernation.ensure_awake(sbx)
            await self._checkpoints.auto.before_call(sbx)
            agent = sbx.agent
            assert agent is not None
            sbx.call = RunningCall(cell.language, cell.context)
            registry.update(sbx, calls=sbx.record.calls + 1)
            registry.touch(sbx)
            t0 = time.monotonic()
            # detached: its block spans the yields (the consumer's code runs between them)
            running = tracing.detached_span("kernel.execute", sandbox_id=sbx.id, language=cell.language)
            try:
                gen = run_cell(
                    agent,
                    cell,
                    self._policy,
                    sbx.call,
                    sbx.session_id,
                    replace_vm=lambda reason: self._recovery.replace_vm(sbx, reason),
                )
                with running as span:
                    async with contextlib.aclosing(gen):
                        async for event in gen:
                            if isinstance(event, End):
                                self.metrics.observe_end(
                                    cell.language, event.status, event.recovery, time.monotonic() - t0
                                )
                                recovery = event.recovery.value if event.recovery else None
                                tracing.set_attributes(span, status=event.status.value, recovery=recovery)
                            yield event
            finally:
                sbx.call = None
                registry.touch(sbx)
                self._checkpoints.auto.after_call(sbx)
