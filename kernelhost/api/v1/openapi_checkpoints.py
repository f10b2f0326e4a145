"""The OpenAPI paths of checkpoints (``api/v1/checkpoints.py``), for ``openapi.py``."""

from __future__ import annotations

from typing import Any

CHECKPOINT_ID = {
    "name": "checkpoint_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^cp_[0-9a-f]{16}$"},
    "description": "a checkpoint's id, `cp_...`",
}
CHECKPOINT: dict[str, Any] = {
    "type": "object",
    "required": ["id", "sandbox_id", "created_at", "bytes"],
    "properties": {
        "id": {"type": "string"},
        "sandbox_id": {"type": "string"},
        "label": {"type": "string"},
        "auto": {"type": "boolean", "description": "taken by auto_checkpoint, before a call"},
        "before_call": {"type": "integer", "description": "auto: the call it is the state before"},
        "created_at": {"type": "string"},
        "bytes": {"type": "integer", "description": "on disk, compressed"},
    },
}
REWOUND = {
    "description": "the checkpoint gone back to, and the sandbox",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {"checkpoint": CHECKPOINT, "sandbox": {"$ref": "#/components/schemas/Sandbox"}},
            }
        }
    },
}
CREATE_FIELDS = {
    "auto_checkpoint": {
        "type": ["boolean", "integer"],
        "description": "keep the state before each call so undo can rewind it (true: 5 calls)",
    },
    "checkpoint": {"type": "string", "description": "start from this checkpoint's state (a branch)"},
}


def checkpoint_paths(op: Any, sandbox_id: dict[str, Any]) -> dict[str, Any]:
    """``op``: openapi.py's operation builder; ``sandbox_id``: its path parameter."""
    one = {"description": "the checkpoint", "content": {"application/json": {"schema": CHECKPOINT}}}
    listed = {
        "description": "the sandbox's checkpoints, oldest first",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {"checkpoints": {"type": "array", "items": CHECKPOINT}},
                }
            }
        },
    }
    return {
        "/v1/sandboxes/{sandbox_id}/checkpoints": {
            "post": op(
                "Checkpoint the sandbox's whole state (variables, files, the shell)",
                {"201": one},
                params=[sandbox_id],
                body={"type": "object", "properties": {"label": {"type": "string", "maxLength": 200}}},
                errors=("400", "401", "404", "429", "503"),
            ),
            "get": op("The sandbox's checkpoints", {"200": listed}, params=[sandbox_id]),
        },
        "/v1/sandboxes/{sandbox_id}/checkpoints/{checkpoint_id}": {
            "get": op("One checkpoint", {"200": one}, params=[sandbox_id, CHECKPOINT_ID]),
            "delete": op(
                "Delete a checkpoint", {"204": {"description": "deleted"}}, params=[sandbox_id, CHECKPOINT_ID]
            ),
        },
        "/v1/sandboxes/{sandbox_id}/restore": {
            "post": op(
                "Rewind the sandbox to one of its checkpoints, in place",
                {"200": REWOUND},
                params=[sandbox_id],
                body={
                    "type": "object",
                    "required": ["checkpoint"],
                    "properties": {"checkpoint": {"type": "string"}},
                },
                errors=("400", "401", "404", "409", "410", "503"),
            ),
        },
        "/v1/sandboxes/{sandbox_id}/undo": {
            "post": op(
                "Rewind to before the n-th last call (the sandbox has auto_checkpoint)",
                {"200": REWOUND},
                params=[sandbox_id],
                body={"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}},
                errors=("400", "401", "404", "409", "410", "503"),
            ),
        },
    }
