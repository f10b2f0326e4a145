"""API keys as the store knows them: a key is never stored, only its id (``key_id``), which
records (``owner``), logs and metrics carry; ``new_api_key`` makes one (the development key)."""

from __future__ import annotations

import hashlib
import secrets


def key_id(api_key: str) -> str:
    """Stable, non-secret identifier of an API key (what logs and records carry)."""
    return "key_" + hashlib.sha256(api_key.encode()).hexdigest()[:12]


def new_api_key() -> str:
    return "kh_" + secrets.token_urlsafe(32)
