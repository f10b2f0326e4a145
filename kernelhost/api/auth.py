"""API keys: from settings (``KERNELHOST_API_KEYS`` or the config file), else a development key
generated at first start and kept in the state directory. A key is never stored, only its id
(``key_id``), which records (``owner``), logs and metrics carry."""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass

from ..config import Settings


def key_id(api_key: str) -> str:
    """Stable, non-secret identifier of an API key (what logs and records carry)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def new_api_key() -> str:
    return "kh_" + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class KeyRing:
    digests: dict[str, str]  # key_id -> sha256 hex of the key
    dev_key: str | None = None  # set when the development key is in use
    dev_key_created: bool = False  # made by this start (printed once, never again)
    operators: frozenset[str] = frozenset()  # key ids of operator keys (docs/cluster.md)

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        keys = list(settings.api_keys)
        dev_key, created = None, False
        if not keys:
            dev_key, created = load_or_create_dev_key(settings)
            keys = [dev_key]
        keys += settings.operator_keys
        operators = frozenset(key_id(k) for k in settings.operator_keys)
        return cls({key_id(k): _digest(k) for k in keys}, dev_key, created, operators)

    def identify(self, presented: str) -> str | None:
        """The key id of a presented key, or None. Constant-time per configured key."""
        digest = _digest(presented)
        found = None
        for kid, want in self.digests.items():
            if hmac.compare_digest(digest, want):
                found = kid
        return found


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def load_or_create_dev_key(settings: Settings) -> tuple[str, bool]:
    """The development key, and whether it was made now."""
    path = settings.dev_key_file
    try:
        key = path.read_text().strip()
        if key:
            return key, False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = new_api_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, True
