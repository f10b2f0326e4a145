"""Typed application keys and the runtime the service holds while it runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hypervisor import Hypervisor

from ..config import Settings
from ..sandboxes import SandboxManager, Store
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

