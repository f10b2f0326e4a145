"""The host's pip configuration, as the host's own pip reads it: which package indexes it uses
(a sandbox's ``allowlist`` network mode and a template's build VM start from them).
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("kernelhost.pip")


@dataclass
class PipIndexes:
    index_url: str | None = None
    extra_index_urls: list[str] = field(default_factory=list)


def pip_config_files(environ: Mapping[str, str]) -> list[Path]:
    """pip's configuration files, in the order pip loads them (later ones override)."""
    xdg_dirs = environ.get("XDG_CONFIG_DIRS") or "/etc/xdg"
    files = [Path(d) / "pip" / "pip.conf" for d in reversed(xdg_dirs.split(":")) if d]
    files.append(Path("/etc/pip.conf"))
    home = Path(environ.get("HOME") or Path.home())
    files.append(home / ".pip" / "pip.conf")
    files.append(Path(environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf")
    if environ.get("VIRTUAL_ENV"):
        files.append(Path(environ["VIRTUAL_ENV"]) / "pip.conf")
    if environ.get("PIP_CONFIG_FILE"):
        files.append(Path(environ["PIP_CONFIG_FILE"]))
    return files


def read_pip_options(
    keys: Sequence[str], environ: Mapping[str, str] | None = None, files: Sequence[Path] | None = None
) -> dict[str, str]:
    """The options ``keys`` as the host's pip sees them: its config files ([global], then
    [install]), then ``PIP_<OPTION>`` variables."""
    env = os.environ if environ is None else environ
    values: dict[str, str] = {}
    for path in pip_config_files(env) if files is None else files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError) as exc:
            log.warning("network.pip_config_unreadable", path=str(path), error=str(exc))
            continue
        for section in ("global", "install"):
            if parser.has_section(section):
                for key in keys:
                    if parser.has_option(section, key):
                        values[key] = parser.get(section, key)
    for key in keys:
        name = "PIP_" + key.upper().replace("-", "_")
        if env.get(name):
            values[key] = env[name]
    return values


def read_pip_config(
    environ: Mapping[str, str] | None = None, files: Sequence[Path] | None = None
) -> PipIndexes:
    """index-url and extra-index-url as the host's pip sees them."""
    values = read_pip_options(("index-url", "extra-index-url"), environ, files)
    index = values.get("index-url", "").strip() or None
    return PipIndexes(index, values.get("extra-index-url", "").split())
