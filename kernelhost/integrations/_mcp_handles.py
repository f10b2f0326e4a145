"""The MCP server's open SDK handles, per API key and sandbox, and the credentials of a call."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from kernelhost.client import AsyncSandbox, KernelHostError, NotFoundError

log = logging.getLogger("kernelhost.mcp")

#: Open SDK handles kept for reuse (each holds an HTTP connection pool).
MAX_HANDLES = 256


@dataclass(frozen=True)
class Credentials:
    """Where the kernelhost service is and which API key to act with (None: the SDK's env)."""

    url: str | None
    api_key: str | None


class Handles:
    """Open SDK handles, per API key and sandbox id, reused across calls.

    At most ``MAX_HANDLES`` stay open (least recently used first out: a handle holds an HTTP
    connection pool). Closing the server releases every handle; with ``delete_created`` it also
    deletes the sandboxes this server created (never those it only attached to).
    """

    def __init__(
        self, template: str, idle_timeout_seconds: int | None, auto_checkpoint: bool | int = False
    ) -> None:
        self.template = template
        self.idle_timeout_seconds = idle_timeout_seconds
        self.auto_checkpoint = auto_checkpoint  # of the sandboxes it creates (undo needs it)
        self._open: OrderedDict[tuple[str, str], AsyncSandbox] = OrderedDict()
        self._created: dict[tuple[str, str], Credentials] = {}

    @staticmethod
    def _key(creds: Credentials, sandbox_id: str) -> tuple[str, str]:
        owner = hashlib.sha256(f"{creds.url}\0{creds.api_key}".encode()).hexdigest()
        return owner, sandbox_id

    async def _keep(self, key: tuple[str, str], sbx: AsyncSandbox) -> AsyncSandbox:
        """Remember ``sbx`` (or keep the handle already there); evict the oldest past the cap."""
        if key in self._open and self._open[key] is not sbx:
            await sbx.detach()  # a concurrent call opened one first
        else:
            self._open[key] = sbx
        self._open.move_to_end(key)
        while len(self._open) > MAX_HANDLES:
            _, oldest = self._open.popitem(last=False)
            await oldest.detach()
        return self._open[key]

    async def create(
        self,
        creds: Credentials,
        template: str | None,
        idle_timeout_seconds: int | None,
        network: str | dict[str, Any] | None = None,
    ) -> AsyncSandbox:
        sbx = await AsyncSandbox.create(
            template=template or self.template,
            url=creds.url,
            api_key=creds.api_key,
            idle_timeout_seconds=idle_timeout_seconds or self.idle_timeout_seconds,
            metadata={"created_by": "kernelhost-mcp"},
            network=network,
            auto_checkpoint=self.auto_checkpoint,
        )
        key = self._key(creds, sbx.id)
        self._created[key] = creds
        return await self._keep(key, sbx)

    async def get(self, creds: Credentials, sandbox_id: str) -> AsyncSandbox:
        key = self._key(creds, sandbox_id)
        if key in self._open:
            self._open.move_to_end(key)
            return self._open[key]
        sbx = await AsyncSandbox.connect(sandbox_id, url=creds.url, api_key=creds.api_key)
        return await self._keep(key, sbx)

    async def adopt(self, creds: Credentials, sbx: AsyncSandbox) -> None:
        key = self._key(creds, sbx.id)
        self._created[key] = creds
        await self._keep(key, sbx)

    async def forget(self, creds: Credentials, sandbox_id: str) -> None:
        """Drop the handle of a sandbox that is gone (deleted elsewhere, expired)."""
        key = self._key(creds, sandbox_id)
        self._created.pop(key, None)
        sbx = self._open.pop(key, None)
        if sbx is not None:
            await sbx.detach()

    async def close(self, creds: Credentials, sandbox_id: str) -> None:
        key = self._key(creds, sandbox_id)
        self._created.pop(key, None)
        sbx = self._open.pop(key, None) or await AsyncSandbox.connect(
            sandbox_id, url=creds.url, api_key=creds.api_key
        )
        await sbx.close()

    async def release(self, delete_created: bool) -> None:
        handles, self._open = self._open, OrderedDict()
        created, self._created = self._created, {}
        for key, sbx in handles.items():
            try:
                if delete_created and created.pop(key, None) is not None:
                    await sbx.close()
                else:
                    await sbx.detach()
            except KernelHostError as exc:
                log.warning("could not release sandbox %s: %s", sbx.id, exc)
        if delete_created:  # created sandboxes whose handle was evicted
            for (_, sandbox_id), creds in created.items():
                try:
                    await (
                        await AsyncSandbox.connect(sandbox_id, url=creds.url, api_key=creds.api_key)
                    ).close()
                except NotFoundError:
                    pass
                except KernelHostError as exc:
                    log.warning("could not delete sandbox %s: %s", sandbox_id, exc)
