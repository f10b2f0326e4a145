"""``/api/kernelspecs``: one kernelspec per template, and their logos."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from aiohttp import web

from ...sandboxes import SandboxManager, TemplateView
from ..state import KEY_ID, RUNTIME

LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")
routes = web.RouteTableDef()


def _manager(request: web.Request) -> SandboxManager:
    return request.app[RUNTIME].manager


def _logo_dir() -> Path | None:
    spec = find_spec("ipykernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "resources"
    return path if path.is_dir() else None


def _ready(request: web.Request) -> dict[str, TemplateView]:
    """The templates the caller's key may start kernels of, by name."""
    views = _manager(request).template_list(request[KEY_ID])
    return {v.name: v for v in views if v.state == "ready"}


def spec_model(view: TemplateView) -> dict[str, Any]:
    name = view.name
    logos = _logo_dir() if view.language == "python" else None
    resources = {
        f.rsplit(".", 1)[0]: f"/kernelspecs/{name}/{f}"
        for f in LOGOS
        if logos is not None and (logos / f).is_file()
    }
    python = view.language == "python"
    return {
        "name": name,
        "resources": resources,
        "spec": {
            # what runs in the VM; shown to clients, never run by them
            "argv": ["python3", "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            if python
            else [view.kernel, "{connection_file}"],
            "display_name": f"{view.display_name or name} (kernelhost VM, {name})",
            "language": view.language,
            "interrupt_mode": "signal",
            "env": {},
            # ipykernel's debugger (debugpy) runs in the guest; debug_request and debug_reply go
            # over control, debug_event over iopub, like any message
            "metadata": {"kernelhost": {"template": name, "kind": view.kind}, "debugger": python},
        },
    }


def default_spec(templates: list[str]) -> str:
    return "python" if "python" in templates or not templates else templates[0]


@routes.get("/api/kernelspecs")
async def list_kernelspecs(request: web.Request) -> web.Response:
    ready = _ready(request)
    return web.json_response(
        {"default": default_spec(list(ready)), "kernelspecs": {n: spec_model(v) for n, v in ready.items()}}
    )


@routes.get("/api/kernelspecs/{name}")
async def get_kernelspec(request: web.Request) -> web.Response:
    name, ready = request.match_info["name"], _ready(request)
    if name not in ready:
        raise web.HTTPNotFound(
            text=json.dumps(
                {
                    "error": {
                        "code": "kernelspec_not_found",
                        "message": f"no kernelspec {name!r}; kernelspecs are the templates: "
                        f"{', '.join(ready) or 'none built (run make image)'}",
                    }
                }
            ),
            content_type="application/json",
        )
    return web.json_response(spec_model(ready[name]))


@routes.get("/kernelspecs/{name}/{file}")
async def kernelspec_resource(request: web.Request) -> web.StreamResponse:
    name, file = request.match_info["name"], request.match_info["file"]
    logos = _logo_dir()
    if name not in _ready(request) or file not in LOGOS or logos is None:
        raise web.HTTPNotFound()
    return web.FileResponse(logos / file)
