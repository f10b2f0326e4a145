"""Checkpoints: a sandbox's whole state kept on disk, to restore, branch from or undo to.

- ``service``: ``Checkpoints``: take, restore, undo, branch, delete, the byte budget;
- ``auto``: ``AutoCheckpoints``: the state before each call (``auto_checkpoint``).

The records are in ``store/checkpoints.py``; the files, through the VM backend
(``VmBackend.checkpoint_files``; the libvirt one is ``vm/saves.py``).
"""

from .service import Checkpoints

__all__ = ["Checkpoints"]
