"""Built guest images: ``<image_dir>/<template>`` links to ``<template>-<key>/`` (see guest-image/).

A full image holds a kernel, an initramfs and a root (``rootfs.erofs``). A template's image is a
layer (``layer.erofs``) over a full one, which its manifest names (``base``: the directory of
that build); its VMs boot the base's kernel and root with the layer stacked over it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ImageNotFound


@dataclass(frozen=True)
class GuestImage:
    template: str
    path: Path
    manifest: dict[str, Any]

    @property
    def base_path(self) -> Path:
        """The full image this one boots: itself, or the build its layer sits on."""
        base = self.manifest.get("base")
        return self.path.parent / base if isinstance(base, str) and base else self.path

    @property
    def kernel(self) -> Path:
        return self.base_path / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.base_path / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.base_path / "rootfs.erofs"

    @property
    def layers(self) -> tuple[Path, ...]:
        return (self.path / "layer.erofs",) if self.base_path != self.path else ()

    @property
    def complete(self) -> bool:
        """Every file a VM of this image needs is there (a layer's base may have been pruned)."""
        return all(p.is_file() for p in (self.kernel, self.initrd, self.rootfs, *self.layers))

    @property
    def key(self) -> str:
        return str(self.manifest.get("key", self.path.name))


class ImageStore:
    """Looks up built images; never builds (that is ``make image``'s job)."""

    def __init__(self, image_dir: Path) -> None:
        self.image_dir = Path(image_dir)

    def templates(self) -> list[str]:
        if not self.image_dir.is_dir():
            return []
        return sorted(
            p.name for p in self.image_dir.iterdir() if p.is_symlink() and (p / "manifest.json").is_file()
        )

    def get_by_key(self, template: str, key: str) -> GuestImage:
        """The exact build a VM was started from (its disk and kernel must not change under it)."""
        path = self.image_dir / f"{template}-{key}"
        if "/" in template + key or not (path / "manifest.json").is_file():
            raise ImageNotFound(f"{template}-{key}", str(self.image_dir), self.templates())
        return GuestImage(template, path, json.loads((path / "manifest.json").read_text()))

    def get(self, template: str) -> GuestImage:
        link = self.image_dir / template
        if "/" in template or template.startswith(".") or not (link / "manifest.json").is_file():
            raise ImageNotFound(template, str(self.image_dir), self.templates())
        path = link.resolve()
        return GuestImage(template, path, json.loads((path / "manifest.json").read_text()))
