"""A sandbox's state machine: how it comes to life, sleeps, recovers and forks.

- ``create``: ``Lifecycle``: create (pool hand-over or launch), bind a channel, loss, remove,
  reconcile at service start;
- ``hibernation``: ``Hibernation`` (hibernate, wake) and ``Reaper`` (the idle sweep);
- ``recovery``: ``Recoverer``: interrupt, kernel restart, a fresh VM (the ladder's last rungs);
- ``fork``: ``Forker``: n live children of a sandbox.
"""

from .create import Lifecycle
from .fork import Forker
from .hibernation import Hibernation, Reaper
from .recovery import Recoverer

__all__ = ["Forker", "Hibernation", "Lifecycle", "Reaper", "Recoverer"]
