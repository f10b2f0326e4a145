"""``/api/kernelspecs``: one kernelspec per template, and their logos.

``python3`` is listed too, as an alias of the Python template (``python``, else the first ready
template whose language is Python) unless a template is named so: it is jupyter_server's and
ipykernel's name for the Python kernel, so notebooks written elsewhere name it, and clients such
as AutoGen's Jupyter executor look it up in this list before they start it. Starting it starts
its template; the kernel's model keeps the name it was started under.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from aiohttp import web

from ...sandboxes import SandboxManager, TemplateView
from ..state import KEY_ID, RUNTIME

LOGOS = ("logo-32x32.png", "logo-64x64.png", "logo-svg.svg")
#: jupyter_server's (and ipykernel's) name of the Python kernel, served as an alias
ALIAS = "python3"
routes = web.RouteTableDef()


def _manager(request: web.Request) -> SandboxManager:
    return request.app[RUNTIME].manager


def _logo_dir() -> Path | None:
    spec = find_spec("ipykernel")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "resources"
    return path if path.is_dir() else None


def ready_templates(manager: SandboxManager, owner: str) -> dict[str, TemplateView]:
    """The templates ``owner`` may start kernels of, by name."""
    return {v.name: v for v in manager.template_list(owner) if v.state == "ready"}


def alias_target(ready: dict[str, TemplateView]) -> str | None:
    """The template ``python3`` stands for: none when a template has that name (it is itself)
    or no ready template runs Python."""
    if ALIAS in ready:
        return None
    if "python" in ready and ready["python"].language == "python":
        return "python"
    return next((n for n, v in ready.items() if v.language == "python"), None)


def kernelspecs(ready: dict[str, TemplateView]) -> dict[str, TemplateView]:
    """Every kernelspec name the caller sees, to the template it starts: the templates, and
    ``python3`` when it is an alias."""
    target = alias_target(ready)
    return {**ready, ALIAS: ready[target]} if target is not None else dict(ready)


def template_of(name: str, ready: dict[str, TemplateView]) -> str:
    """The template a kernelspec name starts (a name no template has is left for the create
    call to refuse, naming the templates)."""
    target = alias_target(ready) if name == ALIAS else None
    return target if target is not None else name


def _ready(request: web.Request) -> dict[str, TemplateView]:
    """The kernelspecs the caller's key may start kernels of, by name (aliases included)."""
    return kernelspecs(ready_templates(_manager(request), request[KEY_ID]))


def spec_model(view: TemplateView, name: str | None = None) -> dict[str, Any]:
    """The kernelspec ``name`` (default: the template's own name) of the template ``view``."""
    name = name or view.name
    alias = name != view.name
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
            "display_name": f"Python 3 (kernelhost VM, {view.name})"
            if alias
            else f"{view.display_name or name} (kernelhost VM, {name})",
            "language": view.language,
            "interrupt_mode": "signal",
            "env": {},
            # ipykernel's debugger (debugpy) runs in the guest; debug_request and debug_reply go
            # over control, debug_event over iopub, like any message
            "metadata": {
                "kernelhost": {"template": view.name, "kind": view.kind}
                | ({"alias_of": view.name} if alias else {}),
                "debugger": python,
            },
        },
    }


def default_spec(templates: list[str]) -> str:
    return "python" if "python" in templates or not templates else templates[0]


@routes.get("/api/kernelspecs")
async def list_kernelspecs(request: web.Request) -> web.Response:
    ready = _ready(request)
    return web.json_response(
        {
            "default": default_spec([n for n in ready if n != ALIAS]),
            "kernelspecs": {n: spec_model(v, n) for n, v in ready.items()},
        }
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
    return web.json_response(spec_model(ready[name], name))


@routes.get("/kernelspecs/{name}/{file}")
async def kernelspec_resource(request: web.Request) -> web.StreamResponse:
    name, file = request.match_info["name"], request.match_info["file"]
    logos = _logo_dir()
    if name not in _ready(request) or file not in LOGOS or logos is None:
        raise web.HTTPNotFound()
    return web.FileResponse(logos / file)
