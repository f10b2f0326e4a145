"""Per-sandbox access tokens: random bearer secrets that an interface hands out for one sandbox
(the E2B surface's ``envdAccessToken``), checked on the calls that name the sandbox instead of
carrying an API key.

A token is 256 bits, minted when it is handed out (at create, fork and each connect): an HMAC,
under the service's token key (a file of its state directory, or derived from a cluster's
``cluster_secret``), of the sandbox's id and a random seed. The store keeps only SHA-256 hashes
of them and their seeds, in the sandbox's record, so a restart keeps them working and a copy of
the database reveals none; with the key, the service can derive them again to check a URL one
of them signed. A sandbox honours its first token and its
``MAX_ACCESS_TOKENS - 1`` newest: each connect mints a new one without cutting off the clients
that hold earlier ones, and the oldest of those age out. A token dies with its sandbox; the
sandboxes of a key removed from the configuration are refused by the interface whatever token
they are shown.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path

TOKEN_PREFIX = "kh_sbx_"
MAX_ACCESS_TOKENS = 16
_NO_MATCH = hashlib.sha256(b"kernelhost: no token matches this").hexdigest()


def new_access_token(key: bytes = b"", sandbox_id: str = "") -> tuple[str, str]:
    """A fresh token and what the store keeps of it: its hash, and (with the service's token
    ``key``) the random seed it was derived from, after a dot. With the key, the service can
    derive the token again (``tokens_of``: to check a URL it signed, E2B's signed URLs); the
    store alone reveals no token."""
    if not key:
        token = TOKEN_PREFIX + secrets.token_urlsafe(32)
        return token, token_hash(token)
    seed = secrets.token_hex(16)
    token = _derived(key, sandbox_id, seed)
    return token, f"{token_hash(token)}.{seed}"


def _derived(key: bytes, sandbox_id: str, seed: str) -> str:
    mac = hmac.new(key, f"{sandbox_id}:{seed}".encode(), hashlib.sha256).digest()
    return TOKEN_PREFIX + base64.urlsafe_b64encode(mac).decode().rstrip("=")


def tokens_of(key: bytes, sandbox_id: str, kept: list[str]) -> list[str]:
    """The tokens of a sandbox that the service can derive again (those minted with ``key``)."""
    out = []
    for entry in kept:
        _, dot, seed = entry.partition(".")
        if dot and seed:
            out.append(_derived(key, sandbox_id, seed))
    return out


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).hexdigest()


def kept_hashes(hashes: list[str], new: str) -> list[str]:
    """``hashes`` with ``new`` added: the first one (the sandbox's creator's) and the newest."""
    out = [*hashes, new]
    if len(out) > MAX_ACCESS_TOKENS:
        out = [out[0], *out[len(out) - MAX_ACCESS_TOKENS + 1 :]]
    return out


def token_matches(hashes: list[str], presented: str) -> bool:
    """Whether ``presented`` is one of the tokens ``hashes`` were made from. The same work
    whatever matches and however many hashes there are (always ``MAX_ACCESS_TOKENS``
    comparisons, stand-ins filling in), so the time taken says nothing about which tokens a
    sandbox has, or whether it has any (or exists)."""
    digest = token_hash(presented)
    found = False
    for want in [*hashes, *[_NO_MATCH] * (MAX_ACCESS_TOKENS - len(hashes))]:
        found |= hmac.compare_digest(digest, want.partition(".")[0])
    return found and bool(presented) and bool(hashes)


KEY_FILE = "access-token-key"


def channel_key(token_key: bytes) -> bytes:
    """The key of the VM channels' request ids (``kernelhost/channel/client.py``), derived from
    the token key: a restarted service, or a cluster's other node, knows its earlier ids."""
    return hmac.new(token_key, b"kernelhost channel request ids", hashlib.sha256).digest()


def load_token_key(state_dir: Path, cluster_secret: str = "") -> bytes:
    """The key tokens are derived under: from ``cluster_secret`` on a cluster's nodes (each
    derives the same), else a random one kept in ``state_dir`` (made at first start, 0600)."""
    if cluster_secret:
        return hmac.new(cluster_secret.encode(), b"kernelhost access tokens", hashlib.sha256).digest()
    path = state_dir / KEY_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        key = path.read_bytes()
        if len(key) < 32:
            raise ValueError(f"{path} holds {len(key)} bytes, not a token key: remove it") from None
        return key
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    return path.read_bytes()
