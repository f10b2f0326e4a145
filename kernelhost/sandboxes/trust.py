"""What a node takes from the store it shares with the others is checked, not trusted
(docs/security.md, "Between cluster nodes"): anyone who can write a row must not be able to
point this node's forwarded calls at a host of theirs, nor make it open, load or delete a file
outside its own directories.

- A node's URL counts only when the row carries the node's registration MAC: an HMAC, with a key
  derived from the cluster secret, over its id and URL (``url_mac``), written by the node itself
  at each heartbeat. A row without it, or whose URL was changed, is *not registered*. Its URL must
  also be ``http(s)://host[:port]``: no user info, path, query or fragment.
- A path from the store (a checkpoint's file, its base snapshot, a hibernated VM's file) must
  resolve (symbolic links and ``..`` followed) inside a directory of this node; ``inside`` says.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path
from urllib.parse import urlsplit


def derive_key(secret: str, purpose: str) -> bytes:
    """A key for one use, derived from the cluster secret (the secret itself signs nothing and
    is never sent)."""
    return hmac.new(secret.encode(), f"kernelhost cluster v1: {purpose}".encode(), hashlib.sha256).digest()


def node_url_mac(secret: str, node_id: str, url: str) -> str:
    """The registration MAC of a node's row."""
    msg = f"{node_id}\n{url}".encode()
    return hmac.new(derive_key(secret, "node url"), msg, hashlib.sha256).hexdigest()


def url_problem(url: str) -> str:
    """Why ``url`` is no node's base URL ('' when it is one)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"scheme {parts.scheme!r} is not http or https"
    if not parts.hostname:
        return "no host"
    if parts.username is not None or parts.password is not None:
        return "it carries user info"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return "it has a path, query or fragment"
    return ""


def registration_problem(secret: str, node_id: str, url: str, mac: str) -> str:
    """Why this node must not send anything to the node row ``node_id``/``url`` ('' if it may):
    no secret configured checks the URL's shape only (a single host's tools)."""
    bad = url_problem(url)
    if bad:
        return f"its URL is refused: {bad}"
    if secret and not hmac.compare_digest(mac.encode(), node_url_mac(secret, node_id, url).encode()):
        return "it is not registered: its row lacks a valid registration MAC (not the cluster secret's)"
    return ""


def inside(path: str | Path, *roots: Path) -> Path | None:
    """``path`` resolved, if it lies inside one of ``roots`` (also resolved); else None."""
    if not str(path):
        return None
    real = Path(os.path.realpath(path))
    for root in roots:
        base = Path(os.path.realpath(root))
        if real != base and real.is_relative_to(base):
            return real
    return None
