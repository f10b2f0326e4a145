"""The host's apt sources, for the guest image's bootstrap (guest-image/build.py): its own
release's, or another release's of the same distribution (a template's ``base = "debian:trixie"``).

Standard library only: it runs before the project's virtualenv exists.
"""

from __future__ import annotations

import re
from pathlib import Path


def codename() -> str:
    for line in Path("/etc/os-release").read_text().splitlines():
        if line.startswith("VERSION_CODENAME="):
            return line.split("=", 1)[1].strip('"')
    raise SystemExit("cannot tell the distribution's codename from /etc/os-release")


def host_sources(suite: str) -> tuple[str, str]:
    """The host's enabled apt sources for ``suite`` (deb822 text, one-line text)."""
    stanzas, lines = [], []
    sources_d = Path("/etc/apt/sources.list.d")
    for path in sorted(sources_d.glob("*.sources")) if sources_d.is_dir() else []:
        for stanza in path.read_text().split("\n\n"):
            body = [ln for ln in stanza.splitlines() if ln.strip() and not ln.startswith("#")]
            fields = {
                ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
                for ln in body
                if ":" in ln and not ln.startswith((" ", "\t"))
            }
            if "deb" not in fields.get("types", "").split():
                continue
            if fields.get("enabled", "yes").lower() == "no":
                continue
            if not any(s.split("-")[0] == suite for s in fields.get("suites", "").split()):
                continue
            stanzas.append("\n".join(body))
    list_files = [Path("/etc/apt/sources.list")]
    list_files += sorted(sources_d.glob("*.list")) if sources_d.is_dir() else []
    for path in list_files:
        if not path.is_file():
            continue
        for ln in path.read_text().splitlines():
            words = ln.split()
            if words and words[0] == "deb" and any(w.split("-")[0] == suite for w in words[1:]):
                lines.append(ln)
    if not stanzas and not lines:
        raise SystemExit(f"no enabled apt source for '{suite}' on this host; configure apt first")
    return "\n\n".join(stanzas) + ("\n" if stanzas else ""), "\n".join(lines) + ("\n" if lines else "")


def sources_for(suite: str) -> tuple[str, str]:
    """The host's apt sources for ``suite``: its own, or, for another release of the same
    distribution, the host's with the suite names changed (``bookworm-security`` ->
    ``trixie-security``)."""
    own = codename()
    if suite == own:
        return host_sources(own)
    deb822, one_line = host_sources(own)
    swap = re.compile(rf"(?<![\w.-]){re.escape(own)}(?=-|\s|$)", re.M)
    return swap.sub(suite, deb822), swap.sub(suite, one_line)
