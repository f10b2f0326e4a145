"""Per-sandbox access tokens: random bearer secrets that an interface hands out for one sandbox
(the E2B surface's ``envdAccessToken``), checked on the calls that name the sandbox instead of
carrying an API key.

A token is 256 random bits, minted when it is handed out (at create, fork and each connect). The
store keeps only SHA-256 hashes of them, in the sandbox's record, so a restart keeps them
working and a copy of the database reveals none. A sandbox honours its first token and its
``MAX_ACCESS_TOKENS - 1`` newest: each connect mints a new one without cutting off the clients
that hold earlier ones, and the oldest of those age out. A token dies with its sandbox; the
sandboxes of a key removed from the configuration are refused by the interface whatever token
they are shown.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TOKEN_PREFIX = "kh_sbx_"
MAX_ACCESS_TOKENS = 16
_NO_MATCH = hashlib.sha256(b"kernelhost: no token matches this").hexdigest()


def new_access_token() -> tuple[str, str]:
    """A fresh token and the hash the store keeps of it."""
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    return token, token_hash(token)


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
        found |= hmac.compare_digest(digest, want)
    return found and bool(presented) and bool(hashes)
