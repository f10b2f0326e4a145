"""The text editor of Anthropic's code execution server tool (``text_editor_code_execution``:
``view``, ``create``, ``str_replace``) on a sandbox's files, and the error code the server tools
answer a failure of the service with. ``kernelhost.integrations.anthropic`` dispatches to it."""

from __future__ import annotations

import base64
from typing import Any

from kernelhost.client import APIError, KernelHostError, NotFoundError, RateLimitError

from ._ops import PathStat, Plan, files_list, files_read, files_write, service_failure, stat_path
from .output import OutputBudget, truncate_text

#: The largest file ``view`` reads (bytes); images and PDFs are sent whole, so keep it modest.
VIEW_MAX_BYTES = 10 * 1024 * 1024

_EDITOR_COMMANDS = ("view", "create", "str_replace")
_IMAGE_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image"),
    (b"\xff\xd8\xff", "image"),
    (b"GIF8", "image"),
    (b"%PDF-", "pdf"),
)


def service_error(exc: KernelHostError) -> str:
    """The server tool's error code for a failure of the service (not of the user's code)."""
    service_failure(exc)  # a bad key or a closed handle raises: the developer must act
    if isinstance(exc, RateLimitError):
        return "too_many_requests"
    return "unavailable"


class _BadInput(Exception):
    """The model's input cannot be carried out; the message says why (``invalid_tool_input``)."""


class _FileNotFound(Exception):
    """The path does not exist (``file_not_found``); the message names it."""


def editor_result(tool_use_id: str, args: dict[str, Any], budget: OutputBudget) -> Plan[dict[str, Any]]:
    def answer(content: dict[str, Any]) -> dict[str, Any]:
        return {
            "type": "text_editor_code_execution_tool_result",
            "tool_use_id": tool_use_id,
            "content": content,
        }

    def error(code: str, message: str | None = None) -> dict[str, Any]:
        content: dict[str, Any] = {"type": "text_editor_code_execution_tool_result_error", "error_code": code}
        if message is not None:
            content["error_message"] = message
        return answer(content)

    command, path = args.get("command"), args.get("path")
    try:
        if command not in _EDITOR_COMMANDS:
            raise _BadInput(f"command {command!r} is not one of {', '.join(_EDITOR_COMMANDS)}")
        if not isinstance(path, str) or not path:
            raise _BadInput("'path' must be a non-empty string (a file path)")
        if command == "create":
            text = args.get("file_text")
            if not isinstance(text, str):
                raise _BadInput("create needs 'file_text' (a string)")
            before = yield from stat_path(path)
            if before.kind == "dir":
                raise _BadInput(f"{path} is a directory; name a file to create")
            yield from _call(files_write(path, text.encode()), path)
            return answer(
                {
                    "type": "text_editor_code_execution_create_result",
                    "is_file_update": before.kind != "missing",
                }
            )
        if command == "view":
            return answer((yield from _view(path, args.get("view_range"), budget)))
        return answer((yield from _str_replace(path, args)))
    except _BadInput as exc:
        return error("invalid_tool_input", str(exc))
    except _FileNotFound as exc:
        return error("file_not_found", str(exc))
    except KernelHostError as exc:
        return error(service_error(exc), str(exc))


def _call(request: Any, path: str) -> Plan[Any]:
    """Make one files.* call; turn the errors that concern the path into the tool's own."""
    try:
        return (yield request)
    except NotFoundError as exc:
        if exc.code == "file_not_found":
            raise _FileNotFound(f"{path} does not exist") from None
        raise
    except APIError as exc:
        if exc.code in ("file_operation_failed", "file_too_large", "invalid_request"):
            raise _BadInput(exc.message) from None
        raise


def _read_file(path: str, stat: PathStat | None = None) -> Plan[bytes]:
    """The bytes of a file of at most ``VIEW_MAX_BYTES``; a directory or larger file is bad
    input, a missing one ``_FileNotFound``. ``stat``: the path's, if already known."""
    if stat is None:
        stat = yield from stat_path(path)
    if stat.kind == "dir":
        raise _BadInput(f"{path} is a directory, not a file")
    if stat.size > VIEW_MAX_BYTES:
        raise _BadInput(
            f"{path} is {stat.size} bytes, over the {VIEW_MAX_BYTES}-byte limit "
            "here; work on it with a bash command instead"
        )
    data: bytes = yield from _call(files_read(path), path)
    return data


def _view(path: str, view_range: Any, budget: OutputBudget) -> Plan[dict[str, Any]]:
    result: dict[str, Any] = {"type": "text_editor_code_execution_view_result"}
    stat = yield from stat_path(path)
    if stat.kind == "dir":
        entries = yield from _call(files_list(path), path)
        listing = "\n".join(e.name + ("/" if e.type == "dir" else "") for e in entries)
        count = len(listing.splitlines())
        return {
            **result,
            "file_type": "text",
            "content": listing,
            "num_lines": count,
            "start_line": 1,
            "total_lines": count,
        }
    raw = yield from _read_file(path, stat)
    for magic, file_type in _IMAGE_MAGIC:
        if raw.startswith(magic):
            return {**result, "file_type": file_type, "content": base64.b64encode(raw).decode("ascii")}
    lines = raw.decode("utf-8", "replace").splitlines(keepends=True)
    start, end = 1, len(lines)
    if isinstance(view_range, list) and len(view_range) == 2 and all(isinstance(v, int) for v in view_range):
        start = max(1, view_range[0])
        end = len(lines) if view_range[1] == -1 else min(len(lines), view_range[1])
    shown = "".join(lines[start - 1 : end])
    return {
        **result,
        "file_type": "text",
        "content": truncate_text(shown, budget.max_chars, budget.head_fraction),
        "num_lines": max(0, end - start + 1),
        "start_line": start,
        "total_lines": len(lines),
    }


def _str_replace(path: str, args: dict[str, Any]) -> Plan[dict[str, Any]]:
    old, new = args.get("old_str"), args.get("new_str", "")
    if not isinstance(old, str) or not old or not isinstance(new, str):
        raise _BadInput("str_replace needs 'old_str' (a non-empty string) and 'new_str' (a string)")
    raw = yield from _read_file(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _BadInput(f"{path} is not UTF-8 text") from None
    count = text.count(old)
    if count != 1:
        raise _BadInput(
            f"old_str was not found in {path}"
            if count == 0
            else f"old_str occurs {count} times in {path}; include more surrounding "
            "lines so that it occurs exactly once"
        )
    yield from _call(files_write(path, text.replace(old, new, 1).encode()), path)
    # The hunk, in whole lines: the lines old_str touched, before and after the replacement.
    at = text.index(old)
    line_start = text.rfind("\n", 0, at) + 1
    newline = text.find("\n", at + len(old))
    line_end = len(text) if newline < 0 else newline
    before = text[line_start:line_end].split("\n")
    after = (text[line_start:at] + new + text[at + len(old) : line_end]).split("\n")
    start = text.count("\n", 0, at) + 1
    return {
        "type": "text_editor_code_execution_str_replace_result",
        "old_start": start,
        "old_lines": len(before),
        "new_start": start,
        "new_lines": len(after),
        "lines": [f"-{line}" for line in before] + [f"+{line}" for line in after],
    }
