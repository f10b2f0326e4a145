"""A node of a cluster, as HTTP (docs/cluster.md): any node serves the whole API.

- ``routing``: placement of creates, the call for a sandbox on another node sent there, 410 for
  a dead node's sandboxes, ``/v1/cluster/nodes`` and drain;
- ``forward``: one request forwarded, bodies streamed both ways, WebSockets bridged;
- ``peers``: the receiving end of a node-to-node call, and the owner it acts for;
- ``signing``: node-to-node calls signed and verified (HMAC, timestamp, nonce cache).
"""

from .routing import cluster_middleware, forward_e2b_sandbox, is_operator, remote_views, setup_cluster

__all__ = ["cluster_middleware", "forward_e2b_sandbox", "is_operator", "remote_views", "setup_cluster"]
