"""E2B's environment variables (``envVars`` at create, ``env_vars`` per execution and ``envs``
per command) as the sandbox's kernel and shell see them: set by a short execution of each,
since a sandbox's processes are already running when the variables arrive."""

from __future__ import annotations

import contextlib
import json
import re
import shlex

from ...sandboxes import End, ExecutionStatus, InvalidRequest, Sandbox, SandboxManager, TemplateNotFound

NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_names(env: dict[str, str]) -> None:
    for name in env:
        if not NAME.fullmatch(name):
            raise InvalidRequest(
                f"environment variable name {name!r} is not valid: use letters, digits and _"
            )


def python_code(env: dict[str, str]) -> str:
    """Set each variable in the Python kernel, leaving no name behind."""
    return f"__import__('os').environ.update({json.dumps(env)})"


def python_push(env: dict[str, str]) -> str:
    """Set the variables for one execution, keeping what they were (``PYTHON_POP`` restores)."""
    return (
        "_kh_env_saved = {k: __import__('os').environ.get(k) for k in "
        + json.dumps(sorted(env))
        + "}\n"
        + python_code(env)
    )


PYTHON_POP = (
    "import os as _kh_os\n"
    "for _kh_k, _kh_v in _kh_env_saved.items():\n"
    "    if _kh_v is None:\n"
    "        _kh_os.environ.pop(_kh_k, None)\n"
    "    else:\n"
    "        _kh_os.environ[_kh_k] = _kh_v\n"
    "del _kh_env_saved, _kh_os, _kh_k, _kh_v"
)


def bash_prefix(env: dict[str, str]) -> str:
    """``export`` lines for one bash command (its own shell state, like ``VAR=x cmd``)."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


async def run_quietly(
    manager: SandboxManager, sbx: Sandbox, code: str, language: str = "python", context: str | None = None
) -> None:
    """Run code whose output nobody reads (in the main kernel, bash, or a code context's kernel);
    raise if it did not end well."""
    events = await manager.execute(sbx, code, language, context=context)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, End) and event.status != ExecutionStatus.OK:
                raise InvalidRequest(f"setting the environment variables failed ({event.status.value})")


async def apply_env(manager: SandboxManager, sbx: Sandbox, env: dict[str, str]) -> None:
    """For every later execution and command of the sandbox (E2B's ``envVars``)."""
    check_names(env)
    await run_quietly(manager, sbx, bash_prefix(env), "bash")
    if kernel_language(manager, sbx) == "python":
        await run_quietly(manager, sbx, python_code(env), "python")


def kernel_language(manager: SandboxManager, sbx: Sandbox) -> str:
    name = sbx.record.template.split("@", 1)[0]
    try:
        return manager.template(sbx.record.owner, name).language
    except TemplateNotFound:  # deleted since (it could not be, while this sandbox uses it)
        return "python"
