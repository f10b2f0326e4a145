"""``kernelhost nodes`` and ``kernelhost node drain``: the cluster (docs/cluster.md), from a
node's own settings. ``nodes`` reads the shared store; ``drain`` asks the node to drain itself
(its advertised URL, in a call signed with a key derived from the cluster secret), so it
hibernates its sandboxes and they wake on other nodes."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..config import ConfigError, Settings


def add_cluster_commands(sub: Any) -> None:
    nodes = sub.add_parser("nodes", help="list the cluster's nodes (reads store_url)")
    nodes.add_argument("--json", action="store_true", help="print JSON")
    nodes.set_defaults(func=_nodes)
    node = sub.add_parser("node", help="operate a node of the cluster")
    nsub = node.add_subparsers(dest="node_command", required=True)
    drain = nsub.add_parser(
        "drain",
        help="stop new placements on a node and hibernate its sandboxes, so they wake elsewhere",
    )
    which = drain.add_mutually_exclusive_group()
    which.add_argument("--node", help="the node's id (default: this one, node_id)")
    which.add_argument("--local", action="store_true", help="this node (what a preStop hook runs)")
    drain.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    drain.set_defaults(func=_drain)


def _settings() -> Settings:
    settings = Settings.load()
    if not settings.cluster:
        raise ConfigError(
            "this node has no cluster store: set store_url (KERNELHOST_STORE_URL) to postgresql://..."
        )
    return settings


def _nodes(args: argparse.Namespace) -> int:
    from ..sandboxes.cluster.node_table import NodeTable
    from ..sandboxes.store.db import open_database

    try:
        settings = _settings()
    except ConfigError as exc:
        print(f"kernelhost nodes: {exc}", file=sys.stderr)
        return 2
    db = open_database(settings.store_url, settings.db_path)
    try:
        nodes = NodeTable(db, settings.node_lease_seconds, settings.cluster_secret).all()
    finally:
        db.close()
    if args.json:
        print(json.dumps([n.to_dict() for n in nodes], indent=2))
        return 0
    print(f"{'NODE':<20} {'STATE':<9} {'AGE':>6} {'SANDBOXES':>9} {'MEMORY MiB':>17}  URL")
    for n in nodes:
        state = "draining" if n.draining and n.alive else ("alive" if n.alive else "dead")
        memory = f"{n.committed_mib}/{n.memory_mib}"
        print(f"{n.id:<20} {state:<9} {n.age:>5.1f}s {n.sandboxes:>9} {memory:>17}  {n.url}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    try:
        settings = _settings()
    except ConfigError as exc:
        print(f"kernelhost node drain: {exc}", file=sys.stderr)
        return 2
    from ..api.cluster.signing import sign

    node = args.node or settings.node_id
    path = f"/v1/cluster/nodes/{urllib.parse.quote(node, safe='')}/drain"
    # signed for this node, as the cluster itself (the owner ''): the secret is never sent
    headers = sign(settings.cluster_secret, "POST", path, owner="", from_node="cli", to_node=settings.node_id)
    req = urllib.request.Request(f"{settings.peer_url}{path}", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=args.timeout) as resp:
            answer = json.load(resp)
    except urllib.error.HTTPError as exc:
        print(f"kernelhost node drain: {exc.code}: {exc.read().decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kernelhost node drain: cannot reach {settings.peer_url}: {exc}", file=sys.stderr)
        return 1
    print(f"node {answer['node']} drains: {answer['hibernated']} sandboxes hibernated")
    return 0
