"""``kernelhost`` command line: ``serve`` runs the service."""

from __future__ import annotations

import argparse
import signal
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


def _mcp(args: argparse.Namespace) -> int:
    import logging

    try:
        from .integrations.mcp_server import create_server, fixed_credentials
        from .integrations.output import OutputBudget
    except ImportError as exc:
        print(f"kernelhost mcp: {exc}", file=sys.stderr)
        return 2
    # stdout carries the protocol: anything else goes to stderr.
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING,
                        format="kernelhost mcp: %(levelname)s %(name)s: %(message)s")
    try:
        budget = OutputBudget(max_chars=args.max_output_chars)
    except ValueError as exc:
        print(f"kernelhost mcp: --max-output-chars: {exc}", file=sys.stderr)
        return 2
    server = create_server(fixed_credentials(args.url, args.api_key), template=args.template,
                           timeout=args.timeout, budget=budget,
                           idle_timeout_seconds=args.idle_timeout,
                           delete_on_exit=not args.keep_sandboxes)

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds the server, which then releases its sandboxes

    signal.signal(signal.SIGTERM, stop)
    try:
        server.run("stdio")
    except KeyboardInterrupt:
        pass
    return 0


def _kernelspec_install(args: argparse.Namespace) -> int:
    """Install a kernelspec whose kernel runs in a kernelhost sandbox (the Jupyter provisioner)."""
    try:
        from .jupyter.kernelspec import install
    except ImportError as exc:
        print(f"kernelhost kernelspec: {exc}; install jupyter_client", file=sys.stderr)
        return 2
    name = args.name or f"kernelhost-{args.template}"
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        where = install(name, args.template, args.display_name, args.url,
                        user=not prefix and not args.system, prefix=prefix)
    except OSError as exc:
        print(f"kernelhost kernelspec: cannot install {name!r}: {exc}; try --user or "
              "--sys-prefix", file=sys.stderr)
        return 1
    print(f"kernelhost: installed kernelspec {name!r} in {where}\n"
          f"  run it with e.g.: jupyter console --kernel {name}  (or papermill -k {name})\n"
          "  it needs KERNELHOST_API_KEY (and KERNELHOST_URL unless --url was given) in the "
          "environment of the Jupyter tool")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelhost", description="Self-hosted code interpreter")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="listen address (default 127.0.0.1, KERNELHOST_HOST)")
    serve.add_argument("--port", type=int, help="listen port (default 8999, KERNELHOST_PORT)")
    serve.set_defaults(func=_serve)
    mcp = sub.add_parser("mcp", help="run an MCP server over stdio (for MCP clients)",
                         description="An MCP server over stdio whose tools create sandboxes on a "
                         "kernelhost service and run code in them. The service also serves the "
                         "same tools over streamable HTTP at /mcp.")
    mcp.add_argument("--url", help="the service (default: KERNELHOST_URL, else "
                     "http://127.0.0.1:8999)")
    mcp.add_argument("--api-key", help="API key (default: KERNELHOST_API_KEY)")
    mcp.add_argument("--template", default="python", help="template of new sandboxes")
    mcp.add_argument("--timeout", type=float, default=120.0,
                     help="seconds before run_code interrupts the code (default 120)")
    mcp.add_argument("--max-output-chars", type=int, default=20_000,
                     help="text budget per tool result; longer output keeps head and tail")
    mcp.add_argument("--idle-timeout", type=int,
                     help="seconds unused before the service deletes a sandbox")
    mcp.add_argument("--keep-sandboxes", action="store_true",
                     help="do not delete the sandboxes this server created when it exits")
    mcp.set_defaults(func=_mcp)
    kspec = sub.add_parser("kernelspec", help="Jupyter kernelspecs that run in sandboxes")
    kspec_sub = kspec.add_subparsers(dest="kernelspec_command", required=True)
    kinstall = kspec_sub.add_parser(
        "install", help="install a kernelspec whose kernel runs in a kernelhost sandbox",
        description="Install a Jupyter kernelspec that uses the kernelhost kernel provisioner: "
        "nbclient, papermill, jupyter nbconvert --execute, jupyter console and a local "
        "jupyter_server then run its code in a kernelhost VM. The API key is read from "
        "KERNELHOST_API_KEY when the kernel starts; it is never written to the kernelspec.")
    kinstall.add_argument("--name", help="kernelspec name (default kernelhost-TEMPLATE)")
    kinstall.add_argument("--template", default="python", help="sandbox template (default python)")
    kinstall.add_argument("--display-name", help="name shown by Jupyter tools")
    kinstall.add_argument("--url", help="the service (default at run time: KERNELHOST_URL, else "
                          "http://127.0.0.1:8999)")
    where = kinstall.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true",
                       help="install for the current user (the default)")
    where.add_argument("--sys-prefix", action="store_true",
                       help="install into this Python environment (sys.prefix)")
    where.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels")
    where.add_argument("--system", action="store_true", help="install system-wide")
    kinstall.set_defaults(func=_kernelspec_install)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
