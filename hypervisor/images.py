"""Built guest images: ``<root>/<template>`` links to ``<template>-<key>/`` (see guest-image/).

Up to two roots: the image dir (the built-in images ``make image`` builds, distribution bases)
and a built dir for the templates a service builds (by default the image dir itself). A full
image holds a kernel, an initramfs and a root (``rootfs.erofs``). A template's image is a layer
(``layer.erofs``) over a full one of the image dir, which its manifest names (``base``: the
directory of that build); its VMs boot the base's kernel and root with the layer stacked over it.
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
    base_dir: Path | None = None  # where a layer's base is (default: beside the layer)

    @property
    def base_path(self) -> Path:
        """The full image this one boots: itself, or the build its layer sits on."""
        base = self.manifest.get("base")
        if not isinstance(base, str) or not base:
            return self.path
        return (self.base_dir or self.path.parent) / base

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
    """Looks up built images in the image dir, then the built dir; never builds (that is ``make
    image``'s job, and the template service's)."""

    def __init__(self, image_dir: Path, built_dir: Path | None = None) -> None:
        self.image_dir = Path(image_dir)
        self.built_dir = Path(built_dir) if built_dir is not None else None

    @property
    def roots(self) -> tuple[Path, ...]:
        if self.built_dir is None or self.built_dir == self.image_dir:
            return (self.image_dir,)
        return (self.image_dir, self.built_dir)

    def templates(self) -> list[str]:
        """Every image a template links to (not the hidden links of distribution bases)."""
        names: set[str] = set()
        for root in self.roots:
            if root.is_dir():
                names.update(
                    p.name
                    for p in root.iterdir()
                    if p.is_symlink() and not p.name.startswith(".") and (p / "manifest.json").is_file()
                )
        return sorted(names)

    def _image(self, template: str, path: Path) -> GuestImage:
        manifest = json.loads((path / "manifest.json").read_text())
        return GuestImage(template, path, manifest, self.image_dir)

    def get_by_key(self, template: str, key: str) -> GuestImage:
        """The exact build a VM was started from (its disk and kernel must not change under it)."""
        if "/" not in template + key:
            for root in self.roots:
                path = root / f"{template}-{key}"
                if (path / "manifest.json").is_file():
                    return self._image(template, path)
        raise ImageNotFound(f"{template}-{key}", str(self.image_dir), self.templates())

    def get(self, template: str) -> GuestImage:
        if "/" not in template and not template.startswith("."):
            for root in self.roots:
                link = root / template
                if (link / "manifest.json").is_file():
                    return self._image(template, link.resolve())
        raise ImageNotFound(template, str(self.image_dir), self.templates())
