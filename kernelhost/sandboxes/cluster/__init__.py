"""A node of a kernelhost cluster (docs/cluster.md): nodes sharing one PostgreSQL store."""

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
