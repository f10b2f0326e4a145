"""``kernelhost serve``: settings, logging and tracing set up once, the service run until
SIGTERM or SIGINT, then the spans still queued flushed (docs/tracing.md). What it imports of
the server extra it imports when it runs: ``kernelhost`` alone still installs the client."""

from __future__ import annotations

import argparse
import asyncio
import sys

from ..config import ConfigError, Settings


def serve_command(args: argparse.Namespace) -> int:
    from .. import logs, tracing  # the server extra's: imported when the command runs

    overrides = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    try:
        settings = Settings.load(**overrides)
    except ConfigError as exc:
        print(f"kernelhost: configuration error: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_format, settings.log_level)
    try:  # OTEL_TRACES_EXPORTER and the other OTEL_* variables (docs/tracing.md)
        tracing.setup(_version(), settings.node_id)
    except tracing.TracingConfigError as exc:
        print(f"kernelhost: configuration error: {exc}", file=sys.stderr)
        return 2
    try:
        return _run_service(settings)
    finally:
        tracing.shutdown()  # the spans still queued leave before the process does


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("kernelhost")
    except metadata.PackageNotFoundError:
        return ""


def _run_service(settings: Settings) -> int:
    from ..api import init_app
    from ..api.auth import KeyRing
    from ..api.server import serve
    from ..sandboxes import BackendUnavailable
    from ..servicelock import ServiceLocked

    keys = KeyRing.from_settings(settings)
    app = init_app(settings, keys)

    def ready() -> None:
        print(f"kernelhost: serving on {settings.url}", file=sys.stderr, flush=True)
        if keys.dev_key_created:  # once: the key must not land in every start's log
            print(
                f"kernelhost: development API key (stored in {settings.dev_key_file}):\n"
                f"  export KERNELHOST_URL={settings.url}\n"
                f"  export KERNELHOST_API_KEY={keys.dev_key}",
                file=sys.stderr,
                flush=True,
            )
        elif keys.dev_key:
            print(
                f"kernelhost: the development API key is in {settings.dev_key_file}:\n"
                f"  export KERNELHOST_URL={settings.url}\n"
                f"  export KERNELHOST_API_KEY=$(cat {settings.dev_key_file})",
                file=sys.stderr,
                flush=True,
            )

    try:
        asyncio.run(serve(app, settings, ready))
    except (BackendUnavailable, ServiceLocked) as exc:
        print(f"kernelhost: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the port: in use, or not ours to bind
        print(f"kernelhost: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    return 0
