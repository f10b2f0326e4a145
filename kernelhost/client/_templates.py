"""Templates in the SDK: build one from a spec (a mapping, or a TOML file with local files),
follow its build, list, look up, cancel and delete. ``AsyncTemplate`` is the original;
``Template`` (``_sync.py``) is derived from it.

    info = await AsyncTemplate.build("ml.toml", on_stage=lambda s, d: print(s, d))
    async with AsyncSandbox(template=info.name) as sbx: ...
"""

from __future__ import annotations

import asyncio
import builtins
import json
import tomllib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

from kernelhost.archive import ArchiveError, local_files, pack_files
from kernelhost.client._exceptions import KernelHostError, TransportError
from kernelhost.client._http import HTTPClient, resolve_config

__all__ = ["AsyncTemplate", "BuildInfo", "TemplateBuildError", "TemplateInfo"]

#: How long ``build`` waits for a build to end (a distribution base bootstraps a whole system).
BUILD_TIMEOUT = 3600.0
POLL_SECONDS = 2.0  # how often an operator template's state is read while it builds

OnStage = Callable[[str, str], object]
OnLog = Callable[[str], object]


class TemplateBuildError(KernelHostError):
    """A build failed or was cancelled: ``stage`` is where, the message what and how to fix it."""

    def __init__(self, message: str, *, stage: str = "", build: BuildInfo | None = None) -> None:
        super().__init__(message)
        self.stage = stage
        self.build = build


@dataclass(frozen=True)
class BuildInfo:
    id: str
    template: str
    state: str  # queued | running | succeeded | cached | failed | cancelled
    stage: str = ""
    stages: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @classmethod
    def from_wire(cls, obj: Any) -> BuildInfo:
        if not isinstance(obj, dict) or "id" not in obj:
            raise TransportError(f"expected a build object, the server sent {obj!r:.300}")
        return cls(
            id=str(obj["id"]),
            template=str(obj.get("template", "")),
            state=str(obj.get("state", "")),
            stage=str(obj.get("stage") or ""),
            stages=list(obj.get("stages") or []),
            error=obj.get("error"),
        )


@dataclass(frozen=True)
class TemplateInfo:
    """A template as the server describes it (``GET /v1/templates/{name}``)."""

    name: str
    kind: str  # builtin | operator | custom
    state: str  # ready | building | failed
    description: str = ""
    kernel: str = "python"
    error: str | None = None
    build: BuildInfo | None = None
    resolved: dict[str, Any] = field(default_factory=dict)  # {"apt": {...}, "pip": {...}}
    size_bytes: int | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_wire(cls, obj: Any) -> TemplateInfo:
        if not isinstance(obj, dict) or "name" not in obj:
            raise TransportError(f"expected a template object, the server sent {obj!r:.300}")
        build = obj.get("build")
        return cls(
            name=str(obj["name"]),
            kind=str(obj.get("kind", "")),
            state=str(obj.get("state", "")),
            description=str(obj.get("description") or ""),
            kernel=str(obj.get("kernel") or "python"),
            error=obj.get("error"),
            build=BuildInfo.from_wire(build) if isinstance(build, dict) and "state" in build else None,
            resolved=dict(obj.get("resolved") or {}),
            size_bytes=obj.get("size_bytes"),
            raw=obj,
        )


def load_spec(spec: Mapping[str, Any] | str | Path) -> tuple[dict[str, Any], bytes | None]:
    """A spec and its files archive: from a mapping (no local files), or a TOML file whose
    ``files`` name local paths relative to it."""
    if isinstance(spec, Mapping):
        data = dict(spec)
        root = Path.cwd()
    else:
        path = Path(spec)
        try:
            data = tomllib.loads(path.read_text())
        except OSError as exc:
            raise KernelHostError(f"cannot read the template spec {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise KernelHostError(f"the template spec {path} is not valid TOML: {exc}") from None
        root = path.parent
    try:
        entries = local_files(data.pop("files", None), root)
        archive = pack_files(entries) if entries else None
    except ArchiveError as exc:
        raise KernelHostError(str(exc)) from None
    return ({**data, "files_dest": "/"}, archive) if archive else (data, None)


class AsyncTemplate:
    """Templates of the service (class methods; nothing to open or close)."""

    @staticmethod
    def _client(url: str | None, api_key: str | None) -> HTTPClient:
        return HTTPClient(resolve_config(url, api_key))

    @classmethod
    async def build(
        cls,
        spec: Mapping[str, Any] | str | Path,
        *,
        url: str | None = None,
        api_key: str | None = None,
        wait: bool = True,
        on_stage: OnStage | None = None,
        on_log: OnLog | None = None,
        timeout: float = BUILD_TIMEOUT,
    ) -> TemplateInfo:
        """Build a template from ``spec`` (a mapping, or a TOML file's path). With ``wait``,
        follow the build (``on_stage(stage, detail)``, ``on_log(line)``) and return the ready
        template, or raise ``TemplateBuildError`` naming the stage that failed."""
        data, archive = load_spec(spec)
        client = cls._client(url, api_key)
        try:
            if archive is None:
                started = await client.request("POST", "/v1/templates", json_body=data)
            else:
                form = aiohttp.FormData()
                form.add_field("spec", _json(data), content_type="application/json")
                form.add_field("files", archive, filename="files.tar.gz", content_type="application/gzip")
                started = await client.request("POST", "/v1/templates", data=form)
            build = BuildInfo.from_wire(started["build"])
            if not wait:
                return TemplateInfo.from_wire(started["template"])
            return await cls._wait(client, build.template, build.id, on_stage, on_log, timeout)
        finally:
            await client.aclose()

    @classmethod
    async def wait(
        cls,
        name: str,
        build_id: str | None = None,
        *,
        url: str | None = None,
        api_key: str | None = None,
        on_stage: OnStage | None = None,
        on_log: OnLog | None = None,
        timeout: float = BUILD_TIMEOUT,
    ) -> TemplateInfo:
        """Follow a build (the template's latest by default) until it ends. The operator's
        templates' builds are not a key's to follow (their logs are the operator's): for one of
        those, wait for the template's state instead (no stages or log lines)."""
        client = cls._client(url, api_key)
        try:
            if build_id is None:
                info = TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))
                if info.build is None:
                    return info
                build_id = info.build.id
                if info.kind == "operator":
                    return await cls._poll(client, name, timeout)
            return await cls._wait(client, name, build_id, on_stage, on_log, timeout)
        finally:
            await client.aclose()

    @classmethod
    async def _poll(cls, client: HTTPClient, name: str, timeout: float) -> TemplateInfo:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            info = TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))
            if info.state != "building":
                break
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"template {name!r} was still building after {timeout:g} s")
            await asyncio.sleep(POLL_SECONDS)
        if info.state == "failed" and info.build is not None:
            raise TemplateBuildError(
                f"template {name!r}: {info.error}", stage=info.build.stage, build=info.build
            )
        return info

    @classmethod
    async def _wait(
        cls,
        client: HTTPClient,
        name: str,
        build_id: str,
        on_stage: OnStage | None,
        on_log: OnLog | None,
        timeout: float,
    ) -> TemplateInfo:
        path = f"/v1/templates/{quote(name)}/builds/{quote(build_id)}"
        async with client.stream("GET", path + "/logs", json_body=None, timeout=timeout) as events:
            async for event in events:
                if "stage" in event and "error" not in event and on_stage is not None:
                    on_stage(str(event["stage"]), str(event.get("detail", "")))
                elif "log" in event and on_log is not None:
                    on_log(str(event["log"]))
        build = BuildInfo.from_wire(await client.request("GET", path))
        if build.state in ("failed", "cancelled"):
            raise TemplateBuildError(
                f"template {name!r}: build {build.id} {build.state}: {build.error}",
                stage=build.stage,
                build=build,
            )
        return TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))

    @classmethod
    async def get(cls, name: str, *, url: str | None = None, api_key: str | None = None) -> TemplateInfo:
        client = cls._client(url, api_key)
        try:
            return TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))
        finally:
            await client.aclose()

    @classmethod
    async def delete(cls, name: str, *, url: str | None = None, api_key: str | None = None) -> None:
        """Delete a template of this key's (``ConflictError`` while sandboxes use it)."""
        client = cls._client(url, api_key)
        try:
            await client.request("DELETE", f"/v1/templates/{quote(name)}")
        finally:
            await client.aclose()

    @classmethod
    async def cancel(
        cls, name: str, build_id: str | None = None, *, url: str | None = None, api_key: str | None = None
    ) -> BuildInfo:
        """Cancel a build (the template's latest by default); nothing of it is left."""
        client = cls._client(url, api_key)
        try:
            if build_id is None:
                info = TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))
                if info.build is None:
                    raise KernelHostError(f"template {name!r} has no build to cancel")
                build_id = info.build.id
            path = f"/v1/templates/{quote(name)}/builds/{quote(build_id)}/cancel"
            return BuildInfo.from_wire(await client.request("POST", path))
        finally:
            await client.aclose()

    @classmethod
    async def logs(
        cls,
        name: str,
        build_id: str | None = None,
        *,
        follow: bool = False,
        url: str | None = None,
        api_key: str | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """A build's log events (``{"stage"}``, ``{"log"}``, ``{"state"}``...)."""
        client = cls._client(url, api_key)
        try:
            if build_id is None:
                info = TemplateInfo.from_wire(await client.request("GET", f"/v1/templates/{quote(name)}"))
                if info.build is None:
                    return
                build_id = info.build.id
            path = f"/v1/templates/{quote(name)}/builds/{quote(build_id)}/logs?follow={str(follow).lower()}"
            async with client.stream("GET", path, json_body=None, timeout=None if follow else 60) as events:
                async for event in events:
                    yield event
        finally:
            await client.aclose()

    # Defined last: inside the class body, the name ``list`` refers to this method afterwards.
    @classmethod
    async def list(cls, *, url: str | None = None, api_key: str | None = None) -> builtins.list[TemplateInfo]:
        """The templates this key may use: its own, the operator's, the built-ins."""
        client = cls._client(url, api_key)
        try:
            body = await client.request("GET", "/v1/templates")
            return [TemplateInfo.from_wire(t) for t in body["templates"]]
        finally:
            await client.aclose()


def _json(data: Any) -> str:
    return json.dumps(data)
