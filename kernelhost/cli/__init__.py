"""``kernelhost`` command line: ``serve`` runs the service; ``ls``, ``run``, ``exec`` and ``rm``
drive one through the SDK (HTTP); ``doctor`` checks the host; ``prune`` removes stale builds;
``migrate`` (``migrate.py``) applies the store's schema migrations."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..config import ConfigError, Settings
from .cluster import add_cluster_commands
from .extras import install_hint, run_command
from .migrate import add_migrate_command
from .serve import serve_command
from .templates import add_template_commands

if TYPE_CHECKING:
    from ..client import AsyncSandbox, Execution


def _mcp(args: argparse.Namespace) -> int:
    import logging

    try:
        from ..integrations.mcp_server import create_server, fixed_credentials
        from ..integrations.output import OutputBudget
    except ImportError as exc:
        print(f"kernelhost mcp: {exc}; {install_hint(exc) or 'pip install kernelhost[mcp]'}", file=sys.stderr)
        return 2
    # stdout carries the protocol: anything else goes to stderr.
    logging.basicConfig(
        stream=sys.stderr, level=logging.WARNING, format="kernelhost mcp: %(levelname)s %(name)s: %(message)s"
    )
    try:
        budget = OutputBudget(max_chars=args.max_output_chars)
    except ValueError as exc:
        print(f"kernelhost mcp: --max-output-chars: {exc}", file=sys.stderr)
        return 2
    server = create_server(
        fixed_credentials(args.url, args.api_key),
        template=args.template,
        timeout=args.timeout,
        budget=budget,
        idle_timeout_seconds=args.idle_timeout,
        delete_on_exit=not args.keep_sandboxes,
    )

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
        from ..jupyter.kernelspec import install
    except ImportError as exc:
        print(f"kernelhost kernelspec: {exc}; pip install 'kernelhost[jupyter]'", file=sys.stderr)
        return 2
    name = args.name or f"kernelhost-{args.template}"
    prefix = sys.prefix if args.sys_prefix else args.prefix
    try:
        where = install(
            name,
            args.template,
            args.display_name,
            args.url,
            user=not prefix and not args.system,
            prefix=prefix,
        )
    except OSError as exc:
        print(
            f"kernelhost kernelspec: cannot install {name!r}: {exc}; try --user or --sys-prefix",
            file=sys.stderr,
        )
        return 1
    print(
        f"kernelhost: installed kernelspec {name!r} in {where}\n"
        f"  run it with e.g.: jupyter console --kernel {name}  (or papermill -k {name})\n"
        "  it needs KERNELHOST_API_KEY (and KERNELHOST_URL unless --url was given) in the "
        "environment of the Jupyter tool"
    )
    return 0


# -- operator commands over the SDK: ls, run, exec, rm -----------------------------------------


def _client_call(command: str, work: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run ``work``; an SDK error becomes one line on stderr and exit status 1 (2: bad setup)."""
    from ..client import AuthenticationError, KernelHostError

    try:
        return asyncio.run(work())
    except AuthenticationError as exc:
        print(f"kernelhost {command}: {exc}", file=sys.stderr)
        return 2
    except (KernelHostError, ValueError) as exc:
        print(f"kernelhost {command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _ls(args: argparse.Namespace) -> int:
    from ..client import AsyncSandbox

    async def work() -> int:
        sandboxes = await AsyncSandbox.list(url=args.url, api_key=args.api_key)
        if args.quiet:
            for s in sandboxes:
                print(s.id)
            return 0
        rows = [("ID", "TEMPLATE", "STATE", "ACCEL", "CREATED", "LAST ACTIVE")] + [
            (
                s.id,
                s.template,
                s.state,
                s.accel or "-",
                s.created_at.strftime("%Y-%m-%d %H:%M:%S") if s.created_at else "-",
                s.last_active_at.strftime("%Y-%m-%d %H:%M:%S") if s.last_active_at else "-",
            )
            for s in sorted(sandboxes, key=lambda s: s.created_at.timestamp() if s.created_at else 0.0)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return 0

    return _client_call("ls", work)


def _read_code(source: str) -> str:
    if source == "-":
        return sys.stdin.read()
    with open(source, encoding="utf-8") as f:
        return f.read()


async def _run_streamed(sbx: AsyncSandbox, code: str, language: str, timeout: float | None) -> int:
    """Run ``code``, printing output as it arrives; exit status 0 only if it ended ``ok``."""
    from ..client import ExecutionError, Result

    def out(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def result(r: Result) -> None:
        if r.text is not None:
            out(r.text + "\n")
        else:
            out(f"<{', '.join(r.formats())} output; the CLI shows text only>\n")

    def error(e: ExecutionError) -> None:
        err("\n".join(e.traceback) + "\n" if e.traceback else f"{e}\n")

    execution: Execution = await sbx.run_code(
        code,
        language=language,
        timeout=timeout,
        on_stdout=out,
        on_stderr=err,
        on_result=result,
        on_error=error,
    )
    if execution.status == "ok":
        return 0
    note = f" (recovery: {execution.recovery})" if execution.recovery else ""
    if execution.status != "error" or language == "bash":
        err(
            f"kernelhost: execution ended with status {execution.status}{note}"
            f"{f', exit code {execution.exit_code}' if execution.exit_code else ''}\n"
        )
    return 1


def _run(args: argparse.Namespace) -> int:
    from ..client import AsyncSandbox

    try:
        code = _read_code(args.file)
    except OSError as exc:
        print(f"kernelhost run: cannot read {args.file!r}: {exc}", file=sys.stderr)
        return 2

    async def work() -> int:
        async with AsyncSandbox(
            template=args.template, url=args.url, api_key=args.api_key
        ) as sbx:  # closed (deleted) on the way out
            return await _run_streamed(sbx, code, args.language, args.timeout)

    return _client_call("run", work)


def _exec(args: argparse.Namespace) -> int:
    from ..client import AsyncSandbox

    code = sys.stdin.read() if args.code == "-" else args.code

    async def work() -> int:
        sbx = await AsyncSandbox.connect(args.id, url=args.url, api_key=args.api_key)
        try:
            return await _run_streamed(sbx, code, args.language, args.timeout)
        finally:
            await sbx.detach()  # the sandbox is kept: close() would delete it

    return _client_call("exec", work)


def _rm(args: argparse.Namespace) -> int:
    from ..client import AsyncSandbox, NotFoundError

    async def work() -> int:
        status = 0
        for sandbox_id in args.ids:
            try:
                sbx = await AsyncSandbox.connect(sandbox_id, url=args.url, api_key=args.api_key)
            except NotFoundError:
                print(f"kernelhost rm: no sandbox {sandbox_id} (for this API key)", file=sys.stderr)
                status = 1
                continue
            await sbx.close()  # deletes the VM and its files
            print(sandbox_id)
        return status

    return _client_call("rm", work)


def _doctor(args: argparse.Namespace) -> int:
    from .doctor import run_checks

    try:
        settings = Settings.load()
    except ConfigError as exc:
        print(
            f"FAIL configuration: {exc}\n       fix: correct the KERNELHOST_* variables or "
            "the KERNELHOST_CONFIG file",
            flush=True,
        )
        return 1
    failed = False
    for check in run_checks(settings, probe_timeout=args.probe_timeout):
        print(check.line(), flush=True)
        failed = failed or (not check.ok and not check.warning)
    print(
        "kernelhost doctor: "
        + ("problems found; fix the FAIL lines above" if failed else "this host can run kernelhost")
    )
    return 1 if failed else 0


def _prune(args: argparse.Namespace) -> int:
    """Remove stale template snapshots and guest image builds (see kernelhost/sandboxes/vm/prune.py)."""
    from hypervisor import Hypervisor, ImageStore, LibvirtUnavailable

    from ..progress import format_bytes
    from ..sandboxes.vm.prune import (
        apply,
        referenced_builds,
        scan_in_use,
        stale_images,
        stale_snapshots,
    )

    try:
        settings = Settings.load()
    except ConfigError as exc:
        print(f"kernelhost prune: configuration error: {exc}", file=sys.stderr)
        return 2
    versions: dict[str, str] | None = None
    hv = Hypervisor(settings.libvirt_uri, settings.domain_prefix, settings.run_dir)
    try:
        versions = hv.versions()
    except LibvirtUnavailable:
        pass  # snapshots are then judged by their image build only
    finally:
        hv.close()
    referenced = referenced_builds(settings.db_path)
    images = ImageStore(settings.image_dir, settings.built_image_dir)
    in_use = scan_in_use()
    plan = stale_snapshots(settings.ram_dir, images, in_use, versions) + stale_images(
        images, referenced, in_use
    )
    for art, why in plan.keep:
        print(f"kept     {art.kind:8} {art.path} ({format_bytes(art.bytes)}): {art.reason}; {why}")
    verb = "would remove" if args.dry_run else "removed"

    def show(art: Any) -> None:
        print(f"{verb:12} {art.kind:8} {art.path} ({format_bytes(art.bytes)}): {art.reason}", flush=True)

    if args.dry_run:
        for art in plan.remove:
            show(art)
        print(
            f"kernelhost prune: would free {format_bytes(plan.bytes)} "
            f"({len(plan.remove)} artifacts); run without --dry-run to remove them"
        )
        return 0
    freed = apply(plan, show)
    print(f"kernelhost prune: freed {format_bytes(freed)} ({len(plan.remove)} artifacts)")
    return 0


def _client_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="the service (default: KERNELHOST_URL, else http://127.0.0.1:8999)")
    parser.add_argument("--api-key", help="API key (default: KERNELHOST_API_KEY)")


def _code_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--language", default="python", choices=("python", "bash"))
    parser.add_argument(
        "--timeout", type=float, help="seconds before the service stops the code (default: its own)"
    )


def _add_operator_commands(sub: Any) -> None:
    ls = sub.add_parser("ls", help="list your sandboxes")
    ls.add_argument("-q", "--quiet", action="store_true", help="print ids only")
    _client_options(ls)
    ls.set_defaults(func=_ls)
    run = sub.add_parser(
        "run",
        help="run a file in a fresh sandbox, streaming its output",
        description="Create a sandbox, run FILE (or standard input with -) in "
        "it while printing its output, then delete the sandbox. The exit status "
        "is 0 when the code ran without error, 1 otherwise.",
    )
    run.add_argument("file", metavar="FILE", help="the code to run, or - for standard input")
    run.add_argument("--template", default="python", help="sandbox template (default python)")
    _code_options(run)
    _client_options(run)
    run.set_defaults(func=_run)
    ex = sub.add_parser(
        "exec",
        help="run code in an existing sandbox (it is kept)",
        description="Run CODE in sandbox ID, printing its output as it comes; "
        "exit status 1 when the code fails.",
    )
    ex.add_argument("id", metavar="ID", help="the sandbox, sbx_...")
    ex.add_argument("code", metavar="CODE", help="the code, or - for standard input")
    _code_options(ex)
    _client_options(ex)
    ex.set_defaults(func=_exec)
    rm = sub.add_parser("rm", help="delete sandboxes (their VMs and files)")
    rm.add_argument("ids", metavar="ID", nargs="+", help="the sandboxes, sbx_...")
    _client_options(rm)
    rm.set_defaults(func=_rm)
    doctor = sub.add_parser(
        "doctor",
        help="check this host (libvirt, QEMU, KVM, images, tmpfs)",
        description="Check what the service needs on this host, with the "
        "service's own settings (KERNELHOST_* variables), and say what to "
        "fix. Exit status 1 when something must be fixed.",
    )
    doctor.add_argument(
        "--probe-timeout", type=float, default=20.0, help="seconds the KVM probe guest may take (default 20)"
    )
    doctor.set_defaults(func=_doctor)
    prune = sub.add_parser(
        "prune",
        help="remove stale template snapshots and guest image builds",
        description="Remove template snapshots (RAM files in the RAM dir) that no clone will start "
        "from again, and guest image builds that are no template's current build, are named by "
        "no sandbox record and are used by no running VM. What a running VM still maps is kept. "
        "Reads the service's own settings; the service may be running. Needs root.",
    )
    prune.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    prune.set_defaults(func=_prune)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kernelhost", description="Self-hosted code interpreter")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    serve.add_argument("--host", help="listen address (default 127.0.0.1, KERNELHOST_HOST)")
    serve.add_argument("--port", type=int, help="listen port (default 8999, KERNELHOST_PORT)")
    serve.set_defaults(func=serve_command)
    mcp = sub.add_parser(
        "mcp",
        help="run an MCP server over stdio (for MCP clients)",
        description="An MCP server over stdio whose tools create sandboxes on a "
        "kernelhost service and run code in them. The service also serves the "
        "same tools over streamable HTTP at /mcp.",
    )
    mcp.add_argument("--url", help="the service (default: KERNELHOST_URL, else http://127.0.0.1:8999)")
    mcp.add_argument("--api-key", help="API key (default: KERNELHOST_API_KEY)")
    mcp.add_argument("--template", default="python", help="template of new sandboxes")
    mcp.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds before run_code interrupts the code (default 120)",
    )
    mcp.add_argument(
        "--max-output-chars",
        type=int,
        default=20_000,
        help="text budget per tool result; longer output keeps head and tail",
    )
    mcp.add_argument("--idle-timeout", type=int, help="seconds unused before the service deletes a sandbox")
    mcp.add_argument(
        "--keep-sandboxes",
        action="store_true",
        help="do not delete the sandboxes this server created when it exits",
    )
    mcp.set_defaults(func=_mcp)
    kspec = sub.add_parser("kernelspec", help="Jupyter kernelspecs that run in sandboxes")
    kspec_sub = kspec.add_subparsers(dest="kernelspec_command", required=True)
    kinstall = kspec_sub.add_parser(
        "install",
        help="install a kernelspec whose kernel runs in a kernelhost sandbox",
        description="Install a Jupyter kernelspec that uses the kernelhost kernel provisioner: "
        "nbclient, papermill, jupyter nbconvert --execute, jupyter console and a local "
        "jupyter_server then run its code in a kernelhost VM. The API key is read from "
        "KERNELHOST_API_KEY when the kernel starts; it is never written to the kernelspec.",
    )
    kinstall.add_argument("--name", help="kernelspec name (default kernelhost-TEMPLATE)")
    kinstall.add_argument("--template", default="python", help="sandbox template (default python)")
    kinstall.add_argument("--display-name", help="name shown by Jupyter tools")
    kinstall.add_argument(
        "--url", help="the service (default at run time: KERNELHOST_URL, else http://127.0.0.1:8999)"
    )
    where = kinstall.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for the current user (the default)")
    where.add_argument(
        "--sys-prefix", action="store_true", help="install into this Python environment (sys.prefix)"
    )
    where.add_argument("--prefix", help="install under PREFIX/share/jupyter/kernels")
    where.add_argument("--system", action="store_true", help="install system-wide")
    kinstall.set_defaults(func=_kernelspec_install)
    _add_operator_commands(sub)
    add_cluster_commands(sub)
    add_migrate_command(sub)
    add_template_commands(sub, _client_options, _client_call)
    args = parser.parse_args(argv)
    return run_command(args.func, args)
