"""The OpenAPI 3.1 document of the native API, served at ``GET /openapi.json``.

Written by hand next to the routes it describes; ``tests/unit/test_openapi.py`` checks that every
``/v1`` and service route is documented and that every documented operation exists, so the two
cannot drift apart silently.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...sandboxes import Remedy, SandboxState
from .openapi_checkpoints import CREATE_FIELDS, checkpoint_paths
from .openapi_templates import template_paths

ID = {
    "name": "sandbox_id",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
    "description": "a sandbox id, `sbx_...`",
}
PATH_Q = {
    "name": "path",
    "in": "query",
    "required": True,
    "schema": {"type": "string"},
    "description": "file path in the sandbox; relative paths are under /home/user",
}


def _err(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


ERRORS = {
    "400": _err("bad input: the message names the field and the fix"),
    "401": _err("missing or unknown API key"),
    "404": _err("no such sandbox for this key (or no such file)"),
    "409": _err("the sandbox is not running (dead or being replaced), or busy"),
    "403": _err("the route needs an operator key (operator_keys)"),
    "410": _err(
        "the checkpoint cannot be loaded any more (its base snapshot is gone), or the cluster node "
        "that held the sandbox failed (its state is lost)"
    ),
    "429": _err("a per-key limit was reached; the message names it"),
    "503": _err(
        "a VM failed to start, libvirt is unreachable, or (a cluster) the sandbox's node did not "
        "answer or no node has room"
    ),
}


NETWORK_MODES = ["none", "allowlist", "outbound"]
NETWORK_REQUEST: dict[str, Any] = {
    "description": "the sandbox's network (docs/network.md): a mode, or a mode with extra "
    "allowlist entries 'host[:port]' ('*.example.org' for subdomains; no port: 80 "
    "and 443); default none",
    "oneOf": [
        {"type": "string", "enum": NETWORK_MODES},
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "mode": {"type": "string", "enum": NETWORK_MODES, "default": "none"},
                "allow": {"type": "array", "maxItems": 64, "items": {"type": "string"}},
            },
        },
    ],
}


def _json(schema_ref: str, description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema_ref}"}}},
    }


def _op(
    summary: str,
    responses: dict[str, Any],
    *,
    params: list[dict[str, Any]] | None = None,
    body: dict[str, Any] | None = None,
    errors: tuple[str, ...] = ("400", "401", "404"),
    secured: bool = True,
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {**responses, **{code: ERRORS[code] for code in errors}},
    }
    if params:
        op["parameters"] = params
    if body:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if not secured:
        op["security"] = []
    return op


def _schemas() -> dict[str, Any]:
    return {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["code", "message"],
                    "properties": {
                        "code": {"type": "string"},
                        "message": {"type": "string"},
                        "remedy": {"type": "string", "enum": [r.value for r in Remedy]},
                        "reason": {"type": "string"},
                        "hint": {"type": "string"},
                    },
                }
            },
        },
        "Sandbox": {
            "type": "object",
            "required": ["id", "template", "state"],
            "properties": {
                "id": {"type": "string"},
                "template": {"type": "string"},
                "state": {"type": "string", "enum": [s.value for s in SandboxState]},
                "created_at": {"type": "string"},
                "last_active_at": {"type": "string"},
                "idle_timeout_seconds": {"type": "integer"},
                "accel": {"type": "string"},
                "memory_mib": {"type": "integer"},
                "vcpus": {"type": "integer"},
                "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                "network": {
                    "type": "object",
                    "properties": {
                        "mode": {"type": "string", "enum": NETWORK_MODES},
                        "allow": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "node": {"type": "string", "description": "the node whose VM it is (docs/cluster.md)"},
                "detail": {"type": "string", "description": "why it is dead, when it is"},
            },
        },
        "SandboxList": {
            "type": "object",
            "required": ["sandboxes"],
            "properties": {"sandboxes": {"type": "array", "items": {"$ref": "#/components/schemas/Sandbox"}}},
        },
        "Event": {
            "type": "object",
            "required": ["type"],
            "description": (
                "one line of the execute stream: stdout, stderr, result (MIME bundle), error, "
                "clear_output, and a final end"
            ),
            "properties": {"type": {"type": "string"}},
        },
    }


def _sandbox_paths() -> dict[str, Any]:
    sandbox = _json("Sandbox", "the sandbox")
    return {
        "/healthz": {
            "get": _op(
                "Service health, acceleration, templates, pool",
                {"200": {"description": "healthy"}},
                errors=(),
                secured=False,
            )
        },
        "/v1/sandboxes": {
            "post": _op(
                "Create a sandbox",
                {"201": sandbox},
                body={
                    "type": "object",
                    "properties": {
                        "template": {"type": "string", "default": "python"},
                        "idle_timeout_seconds": {"type": "integer", "minimum": 1},
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                        "network": NETWORK_REQUEST,
                        **CREATE_FIELDS,
                    },
                },
                errors=("400", "401", "429", "503"),
            ),
            "get": _op("List your sandboxes", {"200": _json("SandboxList", "yours")}, errors=("401",)),
        },
        "/v1/sandboxes/{sandbox_id}": {
            "get": _op("Get a sandbox", {"200": sandbox}, params=[ID]),
            "delete": _op(
                "Delete a sandbox, its VM and every file", {"204": {"description": "deleted"}}, params=[ID]
            ),
        },
    }


def _call_paths() -> dict[str, Any]:
    sandbox = _json("Sandbox", "the sandbox")
    return {
        "/v1/sandboxes/{sandbox_id}/execute": {
            "post": _op(
                "Run code; the answer streams newline-delimited JSON events as they happen",
                {
                    "200": {
                        "description": "event stream",
                        "content": {
                            "application/x-ndjson": {"schema": {"$ref": "#/components/schemas/Event"}}
                        },
                    }
                },
                params=[ID],
                errors=("400", "401", "404", "409"),
                body={
                    "type": "object",
                    "required": ["code"],
                    "properties": {
                        "code": {"type": "string"},
                        "language": {"type": "string", "enum": ["python", "bash"]},
                        "timeout": {"type": ["number", "null"], "exclusiveMinimum": 0},
                    },
                },
            )
        },
        "/v1/sandboxes/{sandbox_id}/fork": {
            "post": _op(
                "Copy a live sandbox into n new ones",
                {"201": _json("SandboxList", "children")},
                params=[ID],
                errors=("400", "401", "404", "409", "429", "503"),
                body={
                    "type": "object",
                    "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 32}},
                },
            )
        },
        "/v1/sandboxes/{sandbox_id}/hibernate": {
            "post": _op(
                "Save the sandbox to disk and stop its VM; its next call wakes it",
                {"200": sandbox},
                params=[ID],
            )
        },
        "/v1/sandboxes/{sandbox_id}/interrupt": {
            "post": _op(
                "Interrupt the running call",
                {"200": {"description": "whether one ran"}},
                params=[ID],
                errors=("401", "404", "409"),
            )
        },
        "/v1/sandboxes/{sandbox_id}/restart": {
            "post": _op(
                "Restart the kernel (or replace a dead VM)",
                {"200": {"description": "recovery"}},
                params=[ID],
                errors=("401", "404", "409", "503"),
            )
        },
    }


def _file_paths() -> dict[str, Any]:
    binary = {"schema": {"type": "string", "format": "binary"}}
    file_errors = ("400", "401", "404", "409")
    return {
        "/v1/sandboxes/{sandbox_id}/files": {
            "put": {
                **_op(
                    "Write a file (raw body, streamed)",
                    {"201": {"description": "written"}},
                    params=[ID, PATH_Q],
                    errors=file_errors,
                ),
                "requestBody": {"required": True, "content": {"application/octet-stream": binary}},
            },
            "get": _op(
                "Read a file (streamed bytes)",
                {"200": {"description": "the bytes", "content": {"application/octet-stream": binary}}},
                params=[ID, PATH_Q],
                errors=file_errors,
            ),
            "delete": _op(
                "Remove a file or directory",
                {"204": {"description": "gone"}},
                params=[ID, PATH_Q, {"name": "recursive", "in": "query", "schema": {"type": "boolean"}}],
                errors=file_errors,
            ),
        },
        "/v1/sandboxes/{sandbox_id}/files/list": {
            "get": _op(
                "List a directory",
                {"200": {"description": "entries"}},
                params=[ID, {**PATH_Q, "required": False}],
                errors=file_errors,
            )
        },
    }


def _cluster_paths() -> dict[str, Any]:
    node = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "url": {"type": "string"},
            "alive": {"type": "boolean"},
            "draining": {"type": "boolean"},
            "heartbeat_age_seconds": {"type": "number"},
            "memory_mib": {"type": "integer"},
            "committed_mib": {"type": "integer"},
            "free_mib": {"type": "integer"},
            "sandboxes": {"type": "integer"},
            "templates": {"type": "array", "items": {"type": "string"}},
            "accel": {"type": "string"},
            "version": {"type": "string"},
            "refused": {
                "type": "string",
                "description": "why no call goes to this node's row (an unregistered or malformed URL); "
                "empty when none (docs/cluster.md, Between nodes)",
            },
        },
    }
    listed = {
        "description": "the cluster's nodes (docs/cluster.md); cluster false on a single host",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "cluster": {"type": "boolean"},
                        "node": {"type": "string"},
                        "nodes": {"type": "array", "items": node},
                    },
                }
            }
        },
    }
    node_id = {"name": "node_id", "in": "path", "required": True, "schema": {"type": "string"}}
    drained = {"description": "the node takes no new sandboxes; its running ones were hibernated"}
    return {
        "/v1/cluster/nodes": {"get": _op("The cluster's nodes", {"200": listed}, errors=("401", "403"))},
        "/v1/cluster/nodes/{node_id}/drain": {
            "post": _op(
                "Drain a node: no new sandboxes, its sandboxes hibernated to wake elsewhere",
                {"200": drained},
                params=[node_id],
                errors=("400", "401", "403", "503"),
            )
        },
    }


def _usage_paths() -> dict[str, Any]:
    count = {"type": ["integer", "null"], "description": "bytes; null: the guest did not answer"}
    sample = {
        "type": "object",
        "properties": {
            "timestamp": {"type": "string"},
            "timestamp_unix": {"type": "number"},
            "cpu_count": {"type": "integer"},
            "cpu_used_pct": {
                "type": ["number", "null"],
                "description": "of all vCPUs since the previous sample (null: the VM's first)",
            },
            "cpu_seconds": {"type": "number", "description": "CPU time of the sandbox's current VM"},
            "host_memory_bytes": {"type": "integer", "description": "QEMU's resident memory"},
            **{name: count for name in ("mem_total", "mem_used", "mem_cache", "disk_used", "disk_total")},
        },
    }
    samples = {
        "description": "the samples in the range, oldest first (docs/configuration.md: "
        "sandbox_metrics_interval; 0: none are taken)",
        "content": {
            "application/json": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "interval_seconds": {"type": "number"},
                        "samples": {"type": "array", "items": sample},
                    },
                }
            }
        },
    }
    when = [
        {"name": name, "in": "query", "schema": {"type": "number"}, "description": f"{what} (Unix seconds)"}
        for name, what in (
            ("start", "the first sample's time at the earliest"),
            ("end", "the last's at the latest"),
        )
    ]
    return {
        "/v1/sandboxes/{sandbox_id}/metrics": {
            "get": _op("The sandbox's CPU, memory and disk over time", {"200": samples}, params=[ID, *when])
        }
    }


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "kernelhost",
            "version": "1",
            "description": "Sandboxed Jupyter kernels in QEMU VMs. Every /v1 call needs "
            "`Authorization: Bearer <key>`.",
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(),
        },
        "security": [{"bearer": []}],
        "paths": {
            **_sandbox_paths(),
            **_call_paths(),
            **_file_paths(),
            **checkpoint_paths(_op, ID),
            **template_paths(_op),
            **_cluster_paths(),
            **_usage_paths(),
        },
    }


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(document())


def setup_openapi(app: web.Application) -> None:
    app.router.add_get("/openapi.json", openapi_json)
