"""``kernelhost template build|ls|rm|logs|cancel``: templates through the SDK, on a running
service. ``build`` shows the build's stages as a progress bar on a terminal (plain lines
otherwise) and, with ``-v``, its log."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from ..progress import Stages

#: every stage a build may pass through, in order (for the bar's count)
BUILD_STAGES = [
    "cached",
    "base",
    "mount",
    "apt",
    "pip",
    "files",
    "setup",
    "kernel",
    "warm-up",
    "pack",
    "snapshot",
]

ClientCall = Callable[[str, Callable[[], Coroutine[Any, Any, int]]], int]


def add_template_commands(
    sub: Any, client_options: Callable[[argparse.ArgumentParser], None], call: ClientCall
) -> None:
    tpl = sub.add_parser("template", help="build and manage your own templates (docs/templates.md)")
    tsub = tpl.add_subparsers(dest="template_command", required=True)
    build = tsub.add_parser(
        "build",
        help="build a template from a TOML spec file",
        description="Build FILE (a template spec, docs/templates.md) on the service; its files are "
        "local paths relative to FILE. Waits for the build and shows its stages; exit status 1 "
        "when it fails, with the stage and what to fix.",
    )
    build.add_argument("file", metavar="FILE", help="the spec, a .toml file")
    build.add_argument("-v", "--verbose", action="store_true", help="print the build's log too")
    build.add_argument("--no-wait", action="store_true", help="start the build and return")
    ls = tsub.add_parser("ls", help="list the templates you may use")
    rm = tsub.add_parser("rm", help="delete one of your templates (not while sandboxes use it)")
    rm.add_argument("name", metavar="NAME")
    logs = tsub.add_parser("logs", help="print a template's build log (the latest build by default)")
    logs.add_argument("name", metavar="NAME")
    logs.add_argument("--build", help="a build id, bld_...")
    logs.add_argument("-f", "--follow", action="store_true", help="follow a running build")
    cancel = tsub.add_parser("cancel", help="cancel a template's running build")
    cancel.add_argument("name", metavar="NAME")
    for parser, func in ((build, _build), (ls, _ls), (rm, _rm), (logs, _logs), (cancel, _cancel)):
        client_options(parser)
        parser.set_defaults(func=lambda args, f=func: f(args, call))


def _build(args: argparse.Namespace, call: ClientCall) -> int:
    from ..client import AsyncTemplate, TemplateBuildError

    async def work() -> int:
        bar = Stages("template", BUILD_STAGES)
        try:
            info = await AsyncTemplate.build(
                args.file,
                url=args.url,
                api_key=args.api_key,
                wait=not args.no_wait,
                on_stage=bar.stage,
                on_log=bar.echo if args.verbose else None,
            )
        except TemplateBuildError as exc:
            bar.finish(str(exc), failed=True)
            print(f"kernelhost template build: {exc}", file=sys.stderr)
            return 1
        bar.finish(info.state)
        print(
            f"kernelhost: template {info.name!r} is {info.state}; use it with Sandbox(template={info.name!r})"
        )
        return 0

    return call("template build", work)


def _ls(args: argparse.Namespace, call: ClientCall) -> int:
    from ..client import AsyncTemplate

    async def work() -> int:
        rows = [("NAME", "KIND", "STATE", "KERNEL", "DESCRIPTION")] + [
            (t.name, t.kind, t.state, t.kernel, (t.error or t.description)[:60])
            for t in await AsyncTemplate.list(url=args.url, api_key=args.api_key)
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        for row in rows:
            print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
        return 0

    return call("template ls", work)


def _rm(args: argparse.Namespace, call: ClientCall) -> int:
    from ..client import AsyncTemplate

    async def work() -> int:
        await AsyncTemplate.delete(args.name, url=args.url, api_key=args.api_key)
        print(f"kernelhost: deleted template {args.name!r}")
        return 0

    return call("template rm", work)


def _logs(args: argparse.Namespace, call: ClientCall) -> int:
    from ..client import AsyncTemplate

    async def work() -> int:
        async for event in AsyncTemplate.logs(
            args.name, args.build, follow=args.follow, url=args.url, api_key=args.api_key
        ):
            if "log" in event:
                print(event["log"])
            elif "stage" in event:
                print(f"==> {event['stage']}: {event.get('detail', '')}")
            elif "state" in event:
                print(f"==> {event['state']}" + (f": {event['error']}" if event.get("error") else ""))
        return 0

    return call("template logs", work)


def _cancel(args: argparse.Namespace, call: ClientCall) -> int:
    from ..client import AsyncTemplate

    async def work() -> int:
        build = await AsyncTemplate.cancel(args.name, url=args.url, api_key=args.api_key)
        print(f"kernelhost: build {build.id} of {args.name!r} is {build.state}")
        return 0

    return call("template cancel", work)
