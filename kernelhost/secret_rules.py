"""What a secret setting must be to count as one (API keys, operator keys, the cluster secret):
never a placeholder of the deploy examples (``deploy/kubernetes/base/secret.example.yaml``), and
not too short or too repetitive to guess. ``Settings.validate`` refuses the rest, naming the
setting and how to make a real value; the value itself is never printed."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

MIN_KEY_CHARS = 16  # an API key or an operator key
MIN_CLUSTER_SECRET_CHARS = 32  # the key every node-to-node signature is derived from
MIN_DISTINCT_CHARS = 8  # "aaaa…" or "12121212…" are not secrets, whatever their length
FIX = "make one with `openssl rand -hex 32`"

#: words that mark a value as a template's placeholder, compared without case, '-' or '_'
_PLACEHOLDER = re.compile(r"changeme|replaceme|placeholder|yoursecret|yourkey|example(key|secret)")


def _squashed(value: str) -> str:
    return re.sub(r"[-_\s]", "", value.lower())


def weakness(value: str, minimum: int) -> str:
    """Why ``value`` is no secret ('' when it will do)."""
    if _PLACEHOLDER.search(_squashed(value)):
        return "is a placeholder of the deploy example (it contains CHANGE-ME or the like)"
    if len(value) < minimum:
        return f"is {len(value)} characters long; use at least {minimum}"
    if len(set(value)) < MIN_DISTINCT_CHARS:
        return f"has only {len(set(value))} distinct characters; use a random value"
    return ""


def check_secrets(
    api_keys: tuple[str, ...], operator_keys: tuple[str, ...], cluster_secret: str, store_url: str
) -> str:
    """The first reason the secret settings cannot be used, or ''."""
    for setting, env, keys in (
        ("api_keys", "KERNELHOST_API_KEYS", api_keys),
        ("operator_keys", "KERNELHOST_OPERATOR_KEYS", operator_keys),
    ):
        for n, key in enumerate(keys, 1):
            why = weakness(key, MIN_KEY_CHARS)
            if why:
                return f"{setting} ({env}): key {n} {why}; {FIX} for each key"
    if cluster_secret:
        why = weakness(cluster_secret, MIN_CLUSTER_SECRET_CHARS)
        if why:
            return f"cluster_secret (KERNELHOST_CLUSTER_SECRET) {why}; {FIX}, the same on every node"
        if cluster_secret in api_keys + operator_keys:
            return (
                "cluster_secret (KERNELHOST_CLUSTER_SECRET) is also an API key: a client would hold "
                f"every node's trust; {FIX}"
            )
    password = urlsplit(store_url).password if store_url.startswith("postgres") else None
    if password and _PLACEHOLDER.search(_squashed(password)):
        return (
            "store_url (KERNELHOST_STORE_URL) has the deploy example's placeholder password; "
            "use the database's real one"
        )
    return ""
