"""A node of a kernelhost cluster (docs/cluster.md): nodes sharing one PostgreSQL store.

- ``membership``: ``Membership``: this service's part in the cluster: join, heartbeat, locate,
  take over, drain;
- ``node_table``: ``NodeTable``, ``Node``: the nodes table and its rows (any node of the
  cluster), heartbeats, ages on the database's clock;
- ``quota``: ``ClusterQuota``: placement and reservations (per-key limits, node room) in one
  transaction.
"""

from .membership import HOST_FAILED, Location, Membership
from .node_table import Figures, Node, NodeTable
from .quota import FORWARDED_RESERVATION, ClusterQuota, Placement

__all__ = [
    "FORWARDED_RESERVATION",
    "HOST_FAILED",
    "ClusterQuota",
    "Figures",
    "Location",
    "Membership",
    "Node",
    "NodeTable",
    "Placement",
]
