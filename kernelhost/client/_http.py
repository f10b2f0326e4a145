"""The SDK's HTTP layer: configuration, one aiohttp session, error mapping, NDJSON streams.

Nothing here knows what a sandbox is beyond its REST path (``sandbox_path``); ``_sandbox.py``
builds on it. Every request runs under ``_translate_errors``, so callers only ever see the SDK's
exception tree.

Each request carries the caller's trace context (``traceparent``) when the application has
``opentelemetry-api`` and a span is current, so the service's spans join the caller's trace
(docs/tracing.md); the SDK needs no OpenTelemetry package and imports none at its own import.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any
from urllib.parse import quote

import aiohttp

from kernelhost.client._exceptions import (
    AuthenticationError,
    FileTooLargeError,
    KernelHostError,
    KernelHostTimeout,
    TransportError,
    error_for_status,
)

DEFAULT_URL = "http://127.0.0.1:8999"
URL_ENV = "KERNELHOST_URL"
API_KEY_ENV = "KERNELHOST_API_KEY"

#: Deadline for opening a TCP connection to the service.
CONNECT_TIMEOUT = 10.0
#: Deadline for short calls (get, list, delete, interrupt).
REQUEST_TIMEOUT = 30.0
#: The longest NDJSON line accepted (a result event carries whole images as base64).
MAX_EVENT_BYTES = 256 * 1024 * 1024
# after a stream's last event: what is read on so the connection can be reused
DRAIN_BYTES = 64 * 1024
DRAIN_SECONDS = 0.25


def sandbox_path(sandbox_id: str, action: str = "") -> str:
    """The REST path of a sandbox, or of one of its actions."""
    path = f"/v1/sandboxes/{quote(sandbox_id, safe='')}"
    return f"{path}/{action}" if action else path


@dataclass(frozen=True)
class Config:
    """Where the service is and how to authenticate, resolved once per sandbox."""

    url: str
    api_key: str


def resolve_config(url: str | None, api_key: str | None) -> Config:
    """Apply the defaults: arguments first, then ``KERNELHOST_URL`` / ``KERNELHOST_API_KEY``.

    Raises ``AuthenticationError`` when no key is found, before any request is made.
    """
    base = url or os.environ.get(URL_ENV) or DEFAULT_URL
    if not base.startswith(("http://", "https://")):
        source = "url=" if url else URL_ENV
        raise ValueError(
            f"{source} is {base!r}, which is not an http(s) URL; use the form 'http://127.0.0.1:8999'"
        )
    key = api_key or os.environ.get(API_KEY_ENV)
    if not key:
        raise AuthenticationError(
            "no API key: pass api_key=... or set the KERNELHOST_API_KEY environment variable "
            "(`kernelhost serve` prints a key the first time it starts)",
            status=None,
            code="missing_api_key",
        )
    return Config(url=base.rstrip("/"), api_key=key)


def _user_agent() -> str:
    try:
        version = importlib_metadata.version("kernelhost")
    except importlib_metadata.PackageNotFoundError:
        version = "0+unknown"
    return f"kernelhost-python/{version}"


@functools.cache
def _opentelemetry() -> tuple[Any, Any] | None:
    """OpenTelemetry's ``trace`` and ``propagate`` modules, imported on the first request; None
    when the application does not have ``opentelemetry-api``."""
    try:
        from opentelemetry import propagate, trace
    except ImportError:
        return None
    return trace, propagate


def trace_headers() -> dict[str, str]:
    """The current span's W3C trace context (``traceparent``, and whatever else the
    application's propagators add) as headers; empty with no OpenTelemetry or no valid span."""
    modules = _opentelemetry()
    if modules is None:
        return {}
    trace, propagate = modules
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    headers: dict[str, str] = {}
    propagate.inject(headers)
    return headers


class HTTPClient:
    """One ``aiohttp.ClientSession`` bound to a service URL and API key.

    The session is created on first use, inside the running event loop (aiohttp requires it),
    and ``aclose`` is idempotent.
    """

    def __init__(self, config: Config) -> None:
        self.config = config
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _get_session(self) -> aiohttp.ClientSession:
        if self._closed:
            raise KernelHostError("this client's HTTP session is closed")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                headers={
                    "Authorization": f"Bearer {self.config.api_key}",
                    "User-Agent": _user_agent(),
                },
            )
        return self._session

    async def _send(self, method: str, url: str, replayable: bool, **kwargs: Any) -> aiohttp.ClientResponse:
        """Send a request; a kept-alive connection the server had closed meanwhile (it restarted)
        fails before any response, so a ``replayable`` request is sent once more on a new one."""
        context = trace_headers()
        if context:
            kwargs["headers"] = {**(kwargs.get("headers") or {}), **context}
        try:
            return await self._get_session().request(method, url, **kwargs)
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError):
            if not replayable:
                raise
        return await self._get_session().request(method, url, **kwargs)

    async def aclose(self) -> None:
        """Close the HTTP session; safe to call more than once."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        timeout: float = REQUEST_TIMEOUT,
        params: Mapping[str, str] | None = None,
        data: Any = None,
    ) -> Any:
        """Send a request and return its decoded JSON body (None for an empty body).

        ``data`` (bytes, a binary file, or an async iterable of bytes) is sent as the raw body
        instead of ``json_body``.
        """
        what = f"{method} {path}"
        deadline = aiohttp.ClientTimeout(total=timeout, connect=CONNECT_TIMEOUT)
        raw = data is not None and not isinstance(data, aiohttp.FormData)
        headers = {"Content-Type": "application/octet-stream"} if raw else None
        # replayable: not a POST (a create that failed this way may have happened), and no
        # streamed body (it cannot be sent twice)
        replayable = data is None or isinstance(data, bytes | aiohttp.FormData)
        with self._translate_errors(what, timeout):
            async with await self._send(
                method,
                self.config.url + path,
                replayable and method != "POST",
                json=json_body,
                timeout=deadline,
                params=params,
                data=data,
                headers=headers,
            ) as resp:
                body = await resp.read()
                if resp.status >= 400:
                    raise _error_from(resp, body, what)
        if not body:
            return None
        return _decode_json(body, what)

    async def download(
        self,
        path: str,
        *,
        params: Mapping[str, str] | None,
        sink: Callable[[bytes], Awaitable[object] | object],
        timeout: float,
        max_bytes: int | None = None,
    ) -> int:
        """GET a raw body and hand it to ``sink`` chunk by chunk; returns the byte count.

        A body shorter than its Content-Length (the server hit an error mid-stream) raises
        ``TransportError``: a download never ends silently short. With ``max_bytes``, a body
        larger than that raises ``FileTooLargeError`` before any of it is read.
        """
        what = f"GET {path}"
        deadline = aiohttp.ClientTimeout(total=timeout, connect=CONNECT_TIMEOUT)
        received = 0
        with self._translate_errors(what, timeout):
            async with await self._send(
                "GET", self.config.url + path, True, params=params, timeout=deadline
            ) as resp:
                if resp.status >= 400:
                    raise _error_from(resp, await resp.read(), what)
                length = resp.content_length
                if max_bytes is not None and (length is None or length > max_bytes):
                    raise FileTooLargeError(
                        f"{what}: the file is {length if length is not None else 'of unknown size'} "
                        f"bytes, over the {max_bytes} this read allows (max_bytes)",
                        status=None,
                        code="file_too_large",
                    )
                async for chunk in resp.content.iter_chunked(1 << 20):
                    received += len(chunk)
                    outcome = sink(chunk)
                    if inspect.isawaitable(outcome):
                        await outcome
                expected = resp.content_length
        if expected is not None and received != expected:
            raise TransportError(
                f"{what} from {self.config.url} ended after {received} of {expected} bytes; "
                "the file may have changed while it was read, or the server failed mid-way"
            )
        return received

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, *, json_body: Any, timeout: float | None
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """Send a request and yield an iterator over the NDJSON objects of its response.

        ``timeout`` bounds the whole exchange, body included; with None only connecting
        is bounded.
        """
        what = f"{method} {path}"
        deadline = aiohttp.ClientTimeout(total=timeout, connect=CONNECT_TIMEOUT, sock_connect=CONNECT_TIMEOUT)
        # an execute runs nothing before its response starts: a connection that failed before
        # any response never reached the code, so it is sent once more
        with self._translate_errors(what, timeout):
            async with await self._send(
                method,
                self.config.url + path,
                True,
                json=json_body,
                timeout=deadline,
                headers={"Accept": "application/x-ndjson"},
            ) as resp:
                if resp.status >= 400:
                    raise _error_from(resp, await resp.read(), what)
                yield _iter_ndjson(resp, what)
                await _drain(resp)

    @contextmanager
    def _translate_errors(self, what: str, timeout: float | None) -> Iterator[None]:
        url = self.config.url
        try:
            yield
        except KernelHostError:
            raise
        except aiohttp.ConnectionTimeoutError as exc:
            raise KernelHostTimeout(
                f"could not connect to kernelhost at {url} within {CONNECT_TIMEOUT:g} s ({what}); "
                f"check that the server is up (`make serve`) and that {URL_ENV} / url= is right"
            ) from exc
        # asyncio.TimeoutError, not the builtin: the two differ on Python 3.10.
        except TimeoutError as exc:
            within = f" within {timeout:g} s" if timeout is not None else ""
            raise KernelHostTimeout(
                f"{what} to {url} got no complete answer{within}; "
                "pass a larger timeout= if the work is expected to take longer"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise TransportError(
                f"cannot reach kernelhost at {url} ({exc.strerror or exc}); is the server "
                f"running? Start it with `make serve` (or `kernelhost serve`), or point "
                f"{URL_ENV} / url= at a running one"
            ) from exc
        except aiohttp.ClientPayloadError as exc:
            raise TransportError(
                f"the response to {what} from {url} ended early ({exc}); "
                "the server may have restarted or dropped the connection"
            ) from exc
        except aiohttp.ClientError as exc:
            raise TransportError(f"{what} to {url} failed: {exc!r}") from exc


def _error_from(resp: aiohttp.ClientResponse, body: bytes, what: str) -> KernelHostError:
    text = body.decode("utf-8", errors="replace")
    try:
        payload = json.loads(text) if text else None
    except ValueError:
        payload = None
    return error_for_status(
        resp.status,
        payload,
        request=what,
        fallback_text=text or (resp.reason or ""),
        retry_after=resp.headers.get("Retry-After"),
    )


def _decode_json(line: bytes, what: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        raise TransportError(f"the response to {what} is not valid JSON: {line[:200]!r}") from None


async def _drain(resp: aiohttp.ClientResponse) -> None:
    """Read the little a stream's reader left (the end of the chunked body after its last
    event), so the connection goes back to the pool instead of being closed. Bounded in bytes
    and time: a response that goes on is closed as before."""
    deadline = asyncio.get_running_loop().time() + DRAIN_SECONDS
    left = DRAIN_BYTES
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ConnectionError):
        while not resp.content.at_eof() and left > 0:
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return
            async with asyncio.timeout(remaining):
                chunk = await resp.content.read(left)
            if not chunk:
                return
            left -= len(chunk)


async def _iter_ndjson(resp: aiohttp.ClientResponse, what: str) -> AsyncIterator[dict[str, Any]]:
    # aiohttp's own line iterator rejects lines over 128 KiB, and one result event can hold a
    # multi-megabyte image, so split the chunks here.
    buf = bytearray()
    scanned = 0  # bytes of buf already known to hold no newline
    async for chunk in resp.content.iter_any():
        buf += chunk
        while (nl := buf.find(b"\n", scanned)) >= 0:
            line = bytes(buf[:nl])
            del buf[: nl + 1]
            scanned = 0
            if line.strip():
                yield _decode_event(line, what)
        scanned = len(buf)
        if len(buf) > MAX_EVENT_BYTES:
            raise TransportError(f"an event in the response to {what} exceeds {MAX_EVENT_BYTES} bytes")
    if bytes(buf).strip():
        yield _decode_event(bytes(buf), what)


def _decode_event(line: bytes, what: str) -> dict[str, Any]:
    event = _decode_json(line, what)
    if not isinstance(event, dict):
        raise TransportError(f"the response to {what} holds a non-object line: {line[:200]!r}")
    return event
