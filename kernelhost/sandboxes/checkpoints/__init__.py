"""Checkpoints: a sandbox's whole state kept on disk, to restore, branch from or undo to.

- ``service``: ``Checkpoints``: take, restore, undo, branch, delete, the byte budget;
- ``auto``: ``AutoCheckpoints``: the state before each call (``auto_checkpoint``);
- ``files``: ``CheckpointFiles``: freeze a VM, diff it against its template snapshot, zstd, load.

The records are in ``store/checkpoints.py``.
"""

from .service import Checkpoints

__all__ = ["Checkpoints"]
