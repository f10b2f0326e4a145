"""The checkpoint tools the adapters offer a model (``checkpoint``, ``restore``, ``undo``), written
once: their names, descriptions and input schemas, the plans that run them on a sandbox, and how
their results and failures read.

``kernelhost.integrations.anthropic`` and ``openai_agents`` answer with ``run_checkpoint_tool``;
the MCP server (``_mcp_checkpoints``) calls the SDK itself, for its structured results, and
reuses the texts. This module imports no framework.
"""

from __future__ import annotations

from typing import Any

from kernelhost.client import APIError, Checkpoint, InvalidRequestError, KernelHostError

from ._ops import Call, Plan, ToolOutput, service_failure

__all__ = [
    "CHECKPOINT",
    "CHECKPOINT_DESCRIPTION",
    "LIST_CHECKPOINTS_REMEDY",
    "NAMES",
    "RESTORE",
    "RESTORE_DESCRIPTION",
    "UNDO",
    "UNDO_HEAD",
    "auto_reach",
    "checkpoint_text",
    "input_schema",
    "keeps_no_auto_checkpoints",
    "no_undo_text",
    "rewound_text",
    "run_checkpoint_tool",
    "tool_specs",
    "undo_description",
]

CHECKPOINT, RESTORE, UNDO = "checkpoint", "restore", "undo"
NAMES = (CHECKPOINT, RESTORE, UNDO)

#: How many calls ``undo`` reaches in a sandbox created with ``auto_checkpoint=True`` (the
#: service's default; an int given as ``auto_checkpoint`` is that number instead).
DEFAULT_UNDO_REACH = 5

CHECKPOINT_DESCRIPTION = (
    "Save the sandbox's whole state now (every variable, import and file) as a checkpoint and "
    "return its checkpoint_id. Take one before a destructive or exploratory step: deleting or "
    "overwriting files, changing data in place, installing or upgrading packages, trying an "
    "approach you may abandon. restore with that checkpoint_id later rewinds the sandbox to exactly "
    "this state. The sandbox goes on unchanged; a label helps you tell checkpoints apart."
)
RESTORE_DESCRIPTION = (
    "Rewind the sandbox to a checkpoint taken earlier with checkpoint: its variables, imports and "
    "files become exactly what they were then, and everything done since (new or changed variables "
    "and files, installed packages) is gone; code still running is stopped. Only checkpoints of the "
    "same sandbox can be restored. The checkpoint is kept, so you can restore it again."
)
UNDO_HEAD = (
    "Undo the last n code executions (default 1): rewind the sandbox to its state just before them, "
    "so the variables, imports and files they (and anything done after them) created or changed "
    "are as they were. Use it right after a step broke or polluted the state."
)
#: what to do about an unknown checkpoint (the service's ``list_checkpoints`` remedy)
LIST_CHECKPOINTS_REMEDY = (
    "pass restore a checkpoint_id that checkpoint returned for this same sandbox (undo reaches only "
    "its last few calls)"
)

_PROPERTIES: dict[str, dict[str, dict[str, Any]]] = {
    CHECKPOINT: {"label": {"type": "string", "description": "Optional: a short name, e.g. 'before cleanup'"}},
    RESTORE: {
        "checkpoint_id": {
            "type": "string",
            "description": "The id checkpoint returned (cp_...), of this same sandbox",
        }
    },
    UNDO: {"n": {"type": "integer", "description": "How many of the last code executions to undo (1)"}},
}
_REQUIRED = {CHECKPOINT: [], RESTORE: ["checkpoint_id"], UNDO: []}


def auto_reach(auto_checkpoint: bool | int) -> int | None:
    """How many calls ``undo`` reaches for a sandbox created with ``auto_checkpoint`` (None: none)."""
    if auto_checkpoint is True:
        return DEFAULT_UNDO_REACH
    if auto_checkpoint is False or not isinstance(auto_checkpoint, int) or auto_checkpoint < 1:
        return None
    return auto_checkpoint


def undo_description(reach: int | None) -> str:
    """``undo``'s description; ``reach``: the calls it can undo (None: not known to be on)."""
    if reach:
        return (
            f"{UNDO_HEAD} This sandbox keeps an automatic checkpoint before each execution, so n can "
            f"be 1 to {reach}. To return to a point of your choosing, use checkpoint and restore."
        )
    return (
        f"{UNDO_HEAD} It works only if the sandbox keeps automatic checkpoints (it was created with "
        "auto_checkpoint); otherwise it changes nothing and says so: then take a checkpoint before "
        "risky steps and go back with restore."
    )


def tool_specs(auto_checkpoint: bool | int, *, strict: bool = False) -> list[tuple[str, str, dict[str, Any]]]:
    """Each tool's name, description and input schema, for a sandbox created with
    ``auto_checkpoint`` (it words undo's description); ``strict`` as for ``input_schema``."""
    descriptions = (
        CHECKPOINT_DESCRIPTION,
        RESTORE_DESCRIPTION,
        undo_description(auto_reach(auto_checkpoint)),
    )
    return [
        (name, text, input_schema(name, strict=strict))
        for name, text in zip(NAMES, descriptions, strict=True)
    ]


def input_schema(name: str, *, strict: bool = False) -> dict[str, Any]:
    """The JSON Schema of a tool's input. ``strict``: every property required, optional ones
    nullable (what OpenAI's strict function calling asks for)."""
    properties = {key: dict(value) for key, value in _PROPERTIES[name].items()}
    required = list(_REQUIRED[name])
    if strict:
        for key, prop in properties.items():
            if key not in required:
                prop["type"] = [prop["type"], "null"]
        required = list(properties)
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


# -- texts -----------------------------------------------------------------------------------------


def _named(cp: Checkpoint, *, when: bool = True) -> str:
    label = f' "{cp.label}"' if cp.label else ""
    taken = f", taken {cp.created_at:%Y-%m-%d %H:%M:%S %Z}".rstrip() if when and cp.created_at else ""
    return f"checkpoint {cp.id}{label}{taken}"


def checkpoint_text(cp: Checkpoint, *, sandbox_id_arg: bool = False) -> str:
    """What a model reads for a new checkpoint: its id, and how to come back to it."""
    args = f'sandbox_id "{cp.sandbox_id}" and ' if sandbox_id_arg else ""
    size = f" ({cp.bytes / 1e6:.1f} MB on the server)" if cp.bytes else ""
    return (
        f"Saved {_named(cp, when=False)} of sandbox {cp.sandbox_id}{size}: its variables, imports "
        "and files as they are now. To come back to exactly this state, call restore with "
        f'{args}checkpoint_id "{cp.id}". The sandbox goes on unchanged until then.'
    )


def rewound_text(cp: Checkpoint, n: int | None = None) -> str:
    """What a model reads after ``restore`` (``n`` None) or ``undo n``."""
    back = f"{cp.sandbox_id} is back at {_named(cp)}"
    head = f"Undid the last {n} code execution(s): sandbox {back}" if n is not None else f"Sandbox {back}"
    return (
        f"{head}. Its variables, imports and files are as they were then; everything done since is "
        "gone, so run again what you still need."
    )


def keeps_no_auto_checkpoints(exc: BaseException) -> bool:
    """True for the service's refusal to ``undo`` in a sandbox created without ``auto_checkpoint``."""
    return isinstance(exc, InvalidRequestError) and "without auto_checkpoint" in exc.message


def no_undo_text(enable: str, sandbox_id: str | None = None) -> str:
    """Why ``undo`` did nothing, what to do instead, and ``enable``: how undo is turned on."""
    which = f"sandbox {sandbox_id}" if sandbox_id else "this sandbox"
    return (
        f"undo is not available: {which} keeps no automatic checkpoints, so nothing was changed. "
        f"Take a checkpoint before risky steps and go back to it with restore. {enable}"
    ).rstrip()


def _failure_text(name: str, exc: KernelHostError, enable: str) -> str:
    if keeps_no_auto_checkpoints(exc):
        return no_undo_text(enable)
    if isinstance(exc, APIError) and exc.remedy == "list_checkpoints":
        return f"{name} failed: {exc.reason}; {LIST_CHECKPOINTS_REMEDY}."
    return f"{name} failed: {exc}"


# -- the plans -----------------------------------------------------------------------------------


def _arguments(name: str, args: dict[str, Any]) -> tuple[Call | None, str]:
    """The SDK call for a tool's input, or None and what is wrong with the input."""
    if name == CHECKPOINT:
        label = args.get("label")
        if label is not None and not isinstance(label, str):
            return None, "label must be a string (or left out)."
        return Call("checkpoint", (label,)), ""
    if name == RESTORE:
        cid = args.get("checkpoint_id")
        if not isinstance(cid, str) or not cid.strip():
            return None, "Missing 'checkpoint_id': pass the id (cp_...) that checkpoint returned."
        return Call("restore", (cid.strip(),)), ""
    if name == UNDO:
        n = args.get("n")
        n = 1 if n is None else n
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            return None, f"n must be a positive integer (how many code executions to undo), got {n!r}."
        return Call("undo", (n,)), ""
    raise ValueError(f"{name!r} is not a checkpoint tool; they are {', '.join(NAMES)}")


def run_checkpoint_tool(name: str, args: dict[str, Any], enable: str = "") -> Plan[ToolOutput]:
    """Run the checkpoint tool ``name`` with the model's input ``args`` on the sandbox.

    ``enable`` says how undo is turned on, for the answer to an undo in a sandbox that keeps no
    automatic checkpoints. Failures of the service are answers
    (``is_error``), except those ``service_failure`` raises (a bad API key, a closed handle).
    """
    call, problem = _arguments(name, args)
    if call is None:
        return ToolOutput(problem, [], True)
    try:
        cp: Checkpoint = yield call
    except KernelHostError as exc:
        service_failure(exc)
        return ToolOutput(_failure_text(name, exc, enable), [], True)
    if name == CHECKPOINT:
        return ToolOutput(checkpoint_text(cp), [], False)
    return ToolOutput(rewound_text(cp, call.args[0] if name == UNDO else None), [], False)
