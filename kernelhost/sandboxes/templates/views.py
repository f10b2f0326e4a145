"""What a template looks like to its users (``TemplateView``), and the names and fixed inputs
the rest of the template code shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypervisor import GuestImage

from ..store.templates import TemplateRecord
from .builds import Build

#: What each named kernel needs in the image, installed before the spec's own packages.
KERNEL_PACKAGES: dict[str, dict[str, list[str]]] = {
    "r": {"apt": ["r-base-core", "r-cran-irkernel"]},
    "bash": {"pip": ["bash_kernel"], "setup": ["python3 -m bash_kernel.install --sys-prefix"]},
}


def image_name(owner: str, name: str) -> str:
    """The image (and snapshot, and pool) name of a template: the operator's by name, a key's
    own qualified by the key's id, so two keys may each have an ``ml``."""
    return f"{name}@{owner}" if owner else name


@dataclass
class TemplateView:
    name: str
    kind: str  # builtin | operator | custom
    state: str  # ready | building | failed
    description: str = ""
    kernel: str = "python"
    language: str = "python"
    display_name: str = ""
    spec: dict[str, Any] | None = None
    build: dict[str, Any] | None = None
    error: str | None = None
    image_key: str | None = None
    size_bytes: int | None = None
    resolved: dict[str, Any] = field(default_factory=dict)
    built_at: str | None = None
    vm: dict[str, Any] = field(default_factory=dict)
    network: dict[str, Any] | None = None

    def wire(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


def builtin_view(image: GuestImage) -> TemplateView:
    m = image.manifest
    kernelspec = str(m.get("kernel") or "kernelhost")
    return TemplateView(
        name=image.template,
        kind="builtin",
        state="ready",
        description=str(m.get("description", "")),
        kernel={"kernelhost": "python", "ir": "r"}.get(kernelspec, kernelspec),
        language=str(m.get("language") or "python"),
        display_name=str(m.get("display_name") or "Python 3 (kernelhost)"),
        image_key=image.key,
        size_bytes=sum(v for v in m.get("sizes", {}).values() if isinstance(v, int)),
        resolved={"apt": dict(p.split(" ", 1) for p in m.get("packages", []) if " " in p)},
        built_at=m.get("built_at"),
    )


def template_view(rec: TemplateRecord, image: GuestImage | None, build: Build | None) -> TemplateView:
    spec = rec.spec
    m = image.manifest if image is not None else {}
    if build is not None and not build.state.finished:
        state = "building"
    else:
        state = "ready" if image is not None else ("building" if rec.state == "building" else "failed")
    return TemplateView(
        name=rec.name,
        kind="operator" if rec.owner == "" else "custom",
        state=state,
        description=str(spec.get("description", "")),
        kernel=str(spec.get("kernel", "python")),
        language=str(m.get("language", spec.get("kernel", "python"))),
        display_name=str(m.get("display_name", "")),
        spec=spec,
        build=build.wire() if build is not None else {"id": rec.build_id} if rec.build_id else None,
        error=rec.error or None,
        image_key=image.key if image is not None else None,
        size_bytes=m.get("sizes", {}).get("layer.erofs") if m else None,
        resolved=m.get("resolved", {}) if m else {},
        built_at=m.get("built_at") if m else None,
        vm=m.get("vm", {}) if m else {},
        network=m.get("network") if m else None,
    )
