"""The host's local package indexes (``file://`` index URLs of its pip configuration), served
read only to sandboxes in network modes that reach them (docs/network.md).

The guest asks for ``http://INDEX_HOST/<n>/<path>``; its tunnel to that virtual origin is
connected to this server's UNIX socket (``HostNetwork.index_endpoint``), in a private directory.
Only files under the index roots are served, never hidden ones; a directory answers with its
``index.html`` (a PEP 503 simple index is such a tree).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import structlog
from aiohttp import web

log = structlog.get_logger("kernelhost.pip_index")


def _target(roots: list[Path], root: str, tail: str) -> Path | None:
    """The file a request names, or None if it names nothing servable."""
    if not root.isdigit() or int(root) >= len(roots):
        return None
    base = roots[int(root)].resolve()
    target = (base / tail).resolve()
    if not target.is_relative_to(base):
        return None
    if target.is_dir():
        target = target / "index.html"
    if any(part.startswith(".") for part in target.relative_to(base).parts):
        return None
    return target if target.is_file() else None


def index_app(roots: list[Path]) -> web.Application:
    async def serve(request: web.Request) -> web.StreamResponse:
        target = _target(roots, request.match_info["root"], request.match_info["tail"])
        if target is None:
            raise web.HTTPNotFound(text="not found\n")
        kind = "text/html" if target.suffix == ".html" else "application/octet-stream"
        return web.FileResponse(target, headers={"Content-Type": kind})

    app = web.Application()
    app.router.add_get("/{root}/{tail:.*}", serve)  # HEAD too
    return app


@contextlib.asynccontextmanager
async def serving(roots: list[Path]) -> AsyncIterator[Path]:
    """Run the index server for ``roots``; yields its socket path, removed on exit."""
    where = Path(tempfile.mkdtemp(prefix="kh-index-"))
    path = where / "index.sock"
    runner = web.AppRunner(index_app(roots), access_log=None)
    await runner.setup()
    try:
        await web.UnixSite(runner, str(path)).start()
        log.info("pip_index.serving", roots=[str(r) for r in roots])
        yield path
    finally:
        await runner.cleanup()
        shutil.rmtree(where, ignore_errors=True)
