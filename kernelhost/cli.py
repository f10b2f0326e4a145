"""``kernelhost`` command line: ``serve`` runs the service."""

from __future__ import annotations

import argparse
import sys

from aiohttp import web

from .config import ConfigError, Settings


def _serve(args: argparse.Namespace) -> int:
    from . import logs
    from .api import init_app
    from .api.auth import KeyRing
    from .sandboxes import BackendUnavailable

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        settings = Settings.load(**overrides)
    except ConfigError as exc:
        print(f"kernelhost: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    keys = KeyRing.from_settings(settings)
    app = init_app(settings, keys)
    print(f"kernelhost: serving on {settings.url}", file=sys.stderr, flush=True)
    if keys.dev_key:
        print(f"kernelhost: development API key (stored in {settings.dev_key_file}):\n"
              f"  export KERNELHOST_URL={settings.url}\n"
              f"  export KERNELHOST_API_KEY={keys.dev_key}", file=sys.stderr, flush=True)
    try:
        web.run_app(app, host=settings.host, port=settings.port, print=None,
                    handler_cancellation=True, shutdown_timeout=10)
    except BackendUnavailable as exc:
        print(f"kernelhost: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelhost", description="Self-hosted code interpreter")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="listen address (default 127.0.0.1, KERNELHOST_HOST)")
    serve.add_argument("--port", type=int, help="listen port (default 8999, KERNELHOST_PORT)")
    serve.set_defaults(func=_serve)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
