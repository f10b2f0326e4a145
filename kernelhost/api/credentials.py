"""Where a caller's API key may come from, and keeping it out of what the service passes on.

The key comes in the ``Authorization`` header (``Bearer <key>`` or Jupyter's ``token <key>``).
On the Kernel Gateway routes (``/api/...``, ``/kernelspecs/...``) it may also come as the query
parameter ``?token=<key>``, as jupyter_server takes it: Open WebUI's Jupyter engine and
smolagents' gateway executors send it so, the channels WebSocket included (a browser cannot
set headers on a WebSocket). The header wins when both are present; the query is read only
when the header carries no ``Bearer``/``token`` key.

A key in a URL must go no further than the check: a call forwarded to another node of a cluster
goes without it (``without_token``), and every log line has ``token=`` values replaced
(``kernelhost.logs.redact``, applied to structlog events and stdlib log records; the service
writes no access log).
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode

from aiohttp import web

#: the path prefixes on which ``?token=`` is a credential (jupyter_server's API)
QUERY_TOKEN_PREFIXES = ("/api/", "/kernelspecs/")
QUERY_PARAM = "token"
SCHEMES = ("bearer", "token")


def takes_query_token(path: str) -> bool:
    return path.startswith(QUERY_TOKEN_PREFIXES)


def presented_key(request: web.Request) -> str:
    """The key the caller presents ("" for none): the header's, else (on the Kernel Gateway
    routes) the ``token`` query parameter's."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() in SCHEMES and presented.strip():
        return presented.strip()
    if takes_query_token(request.path):
        return request.query.get(QUERY_PARAM, "").strip()
    return ""


def without_token(raw_path_qs: str) -> str:
    """``raw_path_qs`` (still encoded) without its ``token`` parameters, on the paths where
    that parameter is a key; any other path and query unchanged, byte for byte."""
    path, sep, query = raw_path_qs.partition("?")
    if not sep or not takes_query_token(path):
        return raw_path_qs
    pairs = parse_qsl(query, keep_blank_values=True)
    if not any(k == QUERY_PARAM for k, _ in pairs):
        return raw_path_qs
    kept = [(k, v) for k, v in pairs if k != QUERY_PARAM]
    return path + ("?" + urlencode(kept) if kept else "")
