"""Settings for a service that runs with no VM: libvirt's ``test:///default`` driver, every
directory under the test's ``tmp_path``, and (optionally) a fake built image of ``python``; the
app's manager put on a fake VM backend (``on_backend``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from hypervisor import Hypervisor, ImageStore
from kernelhost.api.state import KEYS, RUNTIME, Runtime
from kernelhost.config import Settings
from kernelhost.sandboxes import SandboxManager
from kernelhost.sandboxes.store.sandboxes import Store
from kernelhost.sandboxes.vm.backend import VmBackend


def fake_image_dir(tmp_path: Path) -> Path:
    """An image directory holding a built-looking ``python`` template (key ``k1``)."""
    images = tmp_path / "images"
    (images / "python-k1").mkdir(parents=True)
    for name in ("vmlinuz", "initrd.img", "rootfs.erofs"):
        (images / "python-k1" / name).write_bytes(b"x")
    (images / "python-k1" / "manifest.json").write_text(json.dumps({"key": "k1"}))
    (images / "python").symlink_to("python-k1")
    return images


def offline_settings(tmp_path: Path, *, image_dir: Path | None = None, **overrides: Any) -> Settings:
    """Settings on the test driver; ``image_dir`` defaults to an empty (missing) directory."""
    values: dict[str, Any] = dict(
        libvirt_uri="test:///default",
        image_dir=image_dir or tmp_path / "none",
        state_dir=tmp_path / "state",
        run_dir=tmp_path / "run",
        ram_dir=tmp_path / "ram",
        domain_prefix="khunit-",
        accel="tcg",
    )
    values.update(overrides)
    return Settings.load({}, **values)


class FakeServer(Protocol):
    """An in-process stand-in for the service: its aiohttp app, and the URL it is served at."""

    app: web.Application
    url: str


@contextlib.asynccontextmanager
async def serving(fake: FakeServer) -> AsyncIterator[None]:
    """Serve ``fake.app`` on a free loopback port (``fake.url``) until the block ends."""
    runner = web.AppRunner(fake.app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    fake.url = f"http://{host}:{port}"
    try:
        yield
    finally:
        await runner.cleanup()


@contextlib.contextmanager
def serving_in_thread(fake: FakeServer) -> Iterator[None]:
    """``serving`` on an event loop in a thread of its own, for blocking (sync SDK) tests, which
    never yield to a loop of theirs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="fake-kernelhost", daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()
    try:
        asyncio.run_coroutine_threadsafe(stack.enter_async_context(serving(fake)), loop).result(10)
        try:
            yield
        finally:
            asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def on_backend(app: web.Application, settings: Settings, backend: VmBackend) -> list[SandboxManager]:
    """Give ``init_app``'s app, in place of its start-up, a manager on ``backend`` (with a store
    under ``settings.state_dir``); the list holds that manager once the app has started."""
    managers: list[SandboxManager] = []

    async def resources(app: web.Application) -> AsyncIterator[None]:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        store = Store(settings.state_dir / "store.db", settings.node_id)
        hv = Hypervisor(settings.libvirt_uri, settings.domain_prefix, settings.run_dir)
        manager = SandboxManager(settings, hv, ImageStore(settings.image_dir), store, "tcg", backend=backend)
        await manager.start()
        managers.append(manager)
        app[RUNTIME] = Runtime(settings, app[KEYS], store, hv, manager, "tcg", "test", time.time())
        try:
            yield
        finally:
            await manager.close()
            hv.close()
            store.close()

    app.cleanup_ctx.clear()
    app.cleanup_ctx.append(resources)
    return managers
