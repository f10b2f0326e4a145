"""Exceptions raised by the kernelhost SDK.

The tree, split by cause::

    KernelHostError                 any error raised by the SDK (misuse, e.g. a closed sandbox)
     ├── APIError                   the server answered with an error (.status, .code, .message)
     │    ├── AuthenticationError   401, or no API key was given at all
     │    ├── InvalidRequestError   400 / 422: the request was rejected as malformed
     │    ├── NotFoundError         404: no such sandbox (or it belongs to another key)
     │    ├── ConflictError         409: the sandbox is in the wrong state for this call
     │    ├── RateLimitError        429: too many sandboxes or requests (.retry_after)
     │    └── ServerError           5xx: the service failed
     ├── TransportError             no usable answer: server unreachable, connection dropped,
     │                              stream ended early, response not parseable
     └── KernelHostTimeout          a client-side deadline passed (also a builtin TimeoutError)

Code that runs in the sandbox and fails does *not* raise: its error is reported in
``Execution.error`` (an ``ExecutionError`` value) and ``Execution.status``.

Usage::

    try:
        sbx = await AsyncSandbox.create()
    except kernelhost.TransportError:
        ...  # the service is not running
    except kernelhost.APIError as exc:
        print(exc.status, exc.code, exc.message)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "APIError",
    "AuthenticationError",
    "ConflictError",
    "FileTooLargeError",
    "InvalidRequestError",
    "KernelHostError",
    "KernelHostTimeout",
    "NotFoundError",
    "RateLimitError",
    "ServerError",
    "TransportError",
]


class KernelHostError(Exception):
    """Base class of every exception the SDK raises."""


class APIError(KernelHostError):
    """The server answered a request with an error status.

    ``status`` is the HTTP status (``None`` when the SDK refused to send the request),
    ``code`` the server's snake_case error code, ``message`` its human-readable text, and
    ``details`` the whole ``error`` object the server sent (it may carry extra keys).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None,
        code: str,
        request: str | None = None,
        details: Mapping[str, Any] | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.status = status
        self.code = code
        self.request = request
        self.details: dict[str, Any] = dict(details or {})
        text = message
        if status is not None:
            where = f" on {request}" if request else ""
            text = f"{message} (HTTP {status} {code}{where})"
        if hint:
            text = f"{text}; {hint}"
        super().__init__(text)

    @property
    def remedy(self) -> str | None:
        """What the server says the caller can do (``restart``, ``recreate``,
        ``list_sandboxes``, ``list_directory``), for programs that word it themselves."""
        value = self.details.get("remedy")
        return value if isinstance(value, str) else None

    @property
    def reason(self) -> str:
        """The server's message without its advice (which ``message`` ends with)."""
        value = self.details.get("reason")
        return value if isinstance(value, str) else self.message


class AuthenticationError(APIError):
    """The API key is missing, unknown or revoked (HTTP 401)."""


class InvalidRequestError(APIError):
    """The server rejected the request's content (HTTP 400 or 422)."""


class NotFoundError(APIError):
    """The sandbox does not exist, was deleted, or belongs to another API key (HTTP 404)."""


class FileTooLargeError(APIError):
    """The file is larger than the read allows: the server's ``max_file_bytes`` (HTTP 413), or
    the ``max_bytes`` the caller gave."""


class ConflictError(APIError):
    """The sandbox is not in a state that allows this call (HTTP 409)."""


class RateLimitError(APIError):
    """The server refused the request for now (HTTP 429); ``retry_after`` is in seconds, if sent."""

    retry_after: float | None = None


class ServerError(APIError):
    """The service failed while handling the request (HTTP 5xx)."""


class TransportError(KernelHostError):
    """No usable answer came back: the server is unreachable, hung up, or sent garbage."""


class KernelHostTimeout(KernelHostError, TimeoutError):
    """A client-side deadline passed before the server answered."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    413: FileTooLargeError,
    422: InvalidRequestError,
    429: RateLimitError,
}

_HINTS: dict[type[APIError], str] = {
    AuthenticationError: "check the api_key= argument or the KERNELHOST_API_KEY variable",
    RateLimitError: "close sandboxes you no longer need, or retry later",
}


def error_for_status(
    status: int,
    payload: Any,
    *,
    request: str,
    fallback_text: str = "",
    retry_after: str | None = None,
) -> APIError:
    """Build the exception for an error response.

    ``payload`` is the decoded JSON body (``{"error": {"code": ..., "message": ...}}`` by
    contract); anything else, such as a proxy's HTML page, is reported through
    ``fallback_text`` with the code ``http_<status>``.
    """
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict):
        code = str(error.get("code") or f"http_{status}")
        message = str(error.get("message") or fallback_text or code)
        details: dict[str, Any] = error
    else:
        code = f"http_{status}"
        message = fallback_text.strip()[:500] or f"the server answered HTTP {status}"
        details = {}
    if status in _BY_STATUS:
        cls = _BY_STATUS[status]
    elif 500 <= status <= 599:
        cls = ServerError
    else:
        cls = APIError
    exc = cls(
        message,
        status=status,
        code=code,
        request=request,
        details=details,
        hint=_HINTS.get(cls),
    )
    if isinstance(exc, RateLimitError) and retry_after is not None:
        try:
            exc.retry_after = float(retry_after)
        except ValueError:
            exc.retry_after = None  # an HTTP-date; not worth parsing for a local service
    return exc
