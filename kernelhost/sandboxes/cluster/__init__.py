"""A node of a kernelhost cluster (docs/cluster.md): nodes sharing one PostgreSQL store.

- ``node``: ``ClusterNode``: this service as a node: join, heartbeat, locate, take over, drain;
- ``node_table``: ``NodeTable``: the nodes table, heartbeats, ages on the database's clock;
- ``quota``: ``ClusterQuota``: placement and reservations (per-key limits, node room) in one
  transaction.
"""

from .node import HOST_FAILED, ClusterNode, Location
from .node_table import Figures, Node, NodeTable
from .quota import FORWARDED_RESERVATION, ClusterQuota, Placement

__all__ = [
    "FORWARDED_RESERVATION",
    "HOST_FAILED",
    "ClusterNode",
    "ClusterQuota",
    "Figures",
    "Location",
    "Node",
    "NodeTable",
    "Placement",
]
