"""Typed application keys and the runtime the service holds while it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hypervisor import Hypervisor

from ..config import Settings
from ..sandboxes import InvalidRequest, SandboxManager
from ..sandboxes.store import Store
from .auth import KeyRing


@dataclass
class Runtime:
    """What the running service holds; filled by ``_resources`` during start-up."""

    settings: Settings
    keys: KeyRing
    store: Store
    hv: Hypervisor
    manager: SandboxManager
    accel: str
    accel_reason: str
    started_at: float


SETTINGS = web.AppKey("settings", Settings)
KEYS = web.AppKey("keys", KeyRing)
# the caller's key id, set by the auth middleware (aiohttp >= 3.13 has typed request keys)
KEY_ID: Any = web.RequestKey("key_id", str) if hasattr(web, "RequestKey") else "key_id"
RUNTIME = web.AppKey("runtime", Runtime)


async def json_object(request: web.Request, *, null_is_empty: bool = False) -> dict[str, Any]:
    """The request's JSON body, which must be an object; no body is an empty one (and so is
    ``null`` where ``null_is_empty``: Kernel Gateway clients send it)."""
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except ValueError as exc:  # JSONDecodeError, or UnicodeDecodeError for non-UTF-8 bytes
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from None
    if body is None and null_is_empty:
        return {}
    if not isinstance(body, dict):
        raise InvalidRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body
