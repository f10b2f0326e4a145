"""The OpenAPI paths of ``/v1/templates`` (``api/v1/templates.py``), for ``openapi.py``."""

from __future__ import annotations

from typing import Any

NAME = {
    "name": "name",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,39}$"},
    "description": "a template's name",
}
BUILD_ID = {
    "name": "build_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": "a build id, `bld_...`",
}
LIST = {"type": "array", "items": {"type": "string"}}

SPEC: dict[str, Any] = {
    "type": "object",
    "required": ["name"],
    "additionalProperties": False,
    "description": "a template spec (docs/templates.md)",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z][a-z0-9-]{0,39}$"},
        "base": {"type": "string", "description": "a built-in template, or 'debian:<suite>'"},
        "description": {"type": "string"},
        "apt": LIST,
        "pip": LIST,
        "env": {"type": "object", "additionalProperties": {"type": "string"}},
        "setup": LIST,
        "preload": LIST,
        "kernel": {"type": "string", "description": "python, r, bash, or an installed kernelspec"},
        "memory_mib": {"type": "integer", "minimum": 256, "maximum": 65536},
        "vcpus": {"type": "integer", "minimum": 1, "maximum": 64},
        "writable_mib": {"type": "integer", "minimum": 16},
        "network": {"type": "string", "enum": ["none", "allowlist", "outbound"]},
        "allow": LIST,
        "files_dest": {
            "type": "string",
            "description": "where the files archive is unpacked (in the build VM): absolute, no . or ..",
        },
    },
}


def template_paths(op: Any) -> dict[str, Any]:
    """``op``: openapi.py's operation builder."""
    ok = {"description": "the template"}
    return {
        "/v1/templates": {
            "post": {
                **op(
                    "Build a template from a spec (202); follow .../builds/{id}/logs",
                    {"202": {"description": "the template and its build"}},
                    errors=("400", "401", "409"),
                ),
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": SPEC},
                        "multipart/form-data": {
                            "schema": {
                                "type": "object",
                                "properties": {
                                    "spec": SPEC,
                                    "files": {
                                        "type": "string",
                                        "format": "binary",
                                        "description": "a tar.gz",
                                    },
                                },
                            }
                        },
                    },
                },
            },
            "get": op(
                "The templates this key may use", {"200": {"description": "templates"}}, errors=("401",)
            ),
        },
        "/v1/templates/{name}": {
            "get": op(
                "One template: state, stages, resolved packages, size, error", {"200": ok}, params=[NAME]
            ),
            "delete": op(
                "Delete a template of this key's (409 while sandboxes use it)",
                {"204": {"description": "gone"}},
                params=[NAME],
                errors=("401", "404", "409"),
            ),
        },
        "/v1/templates/{name}/builds/{build_id}": {
            "get": op("One build", {"200": {"description": "the build"}}, params=[NAME, BUILD_ID]),
        },
        "/v1/templates/{name}/builds/{build_id}/cancel": {
            "post": op(
                "Cancel a build (nothing of it is left)",
                {"200": {"description": "the build"}},
                params=[NAME, BUILD_ID],
            ),
        },
        "/v1/templates/{name}/builds/{build_id}/logs": {
            "get": op(
                "A build's log as NDJSON, followed live until it ends (?follow=false: what is there)",
                {"200": {"description": "log events", "content": {"application/x-ndjson": {}}}},
                params=[NAME, BUILD_ID, {"name": "follow", "in": "query", "schema": {"type": "boolean"}}],
            ),
        },
    }
