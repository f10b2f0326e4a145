"""What a template's build VM may reach: the package indexes the host's apt and pip are
configured with, and nothing else (docs/templates.md, "Where a build runs").

- apt: the ``http(s)`` URIs of the host's apt sources (``/etc/apt/sources.list`` and
  ``sources.list.d/*.list`` / ``*.sources``), read at service start;
- pip: the host's ``http(s)`` indexes (``HostNetwork.defaults``), its ``file://`` indexes (served
  by the host, read only), and, when the host's pip names no ``index-url``, pip's own default
  index, as the installed pip names it (the project writes no index host of its own); the
  certificate bundle the host's pip trusts (its ``cert`` option), where it names one, goes to the
  build VM with them (a host whose TLS is intercepted by a proxy of its network needs it).

The build VM gets these as an ``allowlist`` policy of the existing tunnel machinery, and the
pip options pointing at them; the host checks every connection it opens (its protections hold).
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path
from typing import Any

import structlog

from ...pipconfig import read_pip_options
from .host import HostNetwork, url_entry
from .policy import AllowEntry, Policy

log = structlog.get_logger("kernelhost.network")

APT_DIR = Path("/etc/apt")
CERT_MAX = 4 << 20  # bytes of the host pip's certificate bundle handed to a build VM


def apt_source_urls(apt_dir: Path = APT_DIR) -> list[str]:
    """The ``http(s)`` URIs of the host's apt sources, one-line and deb822 formats."""
    urls: list[str] = []
    files = [apt_dir / "sources.list", *sorted((apt_dir / "sources.list.d").glob("*"))]
    for path in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            found = re.findall(r"(?im)^URIs:\s*(.+)$", text)
            words = [w for line in found for w in line.split()]
        elif path.name == "sources.list" or path.suffix == ".list":
            words = [
                w
                for line in text.splitlines()
                if line.strip().startswith(("deb ", "deb-src ", "deb\t"))
                for w in line.split()
                if "://" in w
            ]
        else:
            continue
        urls += [w for w in words if w.lower().startswith(("http://", "https://")) and w not in urls]
    return urls


def pip_default_index() -> tuple[str, str] | None:
    """(the simple index URL, the file host) of the installed pip's default index, or None."""
    try:
        module: Any = importlib.import_module("pip._internal.models.index")
        pypi = module.PyPI
        return str(pypi.simple_url), str(pypi.file_storage_domain)
    except (ImportError, AttributeError) as exc:
        log.warning("network.pip_default_unknown", error=str(exc))
        return None


def _entry(url: str) -> AllowEntry | None:
    try:
        return url_entry(url)
    except ValueError:
        log.warning("network.build_index_unusable", url=url)
        return None


class BuildIndexes:
    """The build VMs' network, discovered once from the host's configuration."""

    def __init__(self, host: HostNetwork, apt_dir: Path = APT_DIR) -> None:
        self.host = host
        self.apt = apt_source_urls(apt_dir)
        self.pip: dict[str, Any] = dict(host.guest_pip)
        extra: list[AllowEntry | None] = [_entry(u) for u in self.apt]
        default = None if host.pip.index_url else pip_default_index()
        if default is not None:
            index, files_host = default
            # the host's pip uses its default index first, then the extra ones
            urls = [index, *([self.pip["index-url"]] if self.pip.get("index-url") else [])]
            self.pip = {
                "index-url": urls[0],
                "extra-index-url": [*urls[1:], *self.pip.get("extra-index-url", [])],
                "trusted-host": list(self.pip.get("trusted-host", [])),
            }
            extra += [_entry(index), _entry(f"https://{files_host}")]
        self.entries = [e for e in extra if e is not None]
        cert = Path(read_pip_options(("cert",)).get("cert", "") or "/nonexistent")
        self.cert = cert if cert.is_file() and cert.stat().st_size <= CERT_MAX else None

    def policy(self) -> Policy:
        """An allowlist of the host's package indexes and the operator's entries."""
        return Policy(self.host, "allowlist", [*self.host.defaults, *self.host.operator, *self.entries])

    def describe(self) -> str:
        return ", ".join(sorted({f"{e.host}:{e.port}" for e in [*self.host.defaults, *self.entries]}))
