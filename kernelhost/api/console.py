"""The web console at ``/``: a notebook-style page (plain HTML and JavaScript, no build step).

The page and its two files need no key; the page asks for one and calls ``/v1`` with it. A
strict Content-Security-Policy keeps what sandboxes send (HTML results render in a sandboxed
iframe) from running script in the page.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).parent / "static"
FILES = {
    "/": ("index.html", "text/html"),
    "/console.js": ("console.js", "text/javascript"),
    "/console.css": ("console.css", "text/css"),
}
PATHS = frozenset(FILES)
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; frame-src 'self' about:; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'none'"
)


async def _serve(request: web.Request) -> web.Response:
    name, content_type = FILES[request.path]
    return web.Response(
        body=(STATIC / name).read_bytes(),
        content_type=content_type,
        charset="utf-8",
        headers={
            "Content-Security-Policy": CSP,
            "Cache-Control": "no-cache",
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        },
    )


def setup_console(app: web.Application) -> None:
    for path in FILES:
        app.router.add_get(path, _serve)
