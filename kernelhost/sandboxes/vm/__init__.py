"""How a VM comes and goes: knows the channel and ``hypervisor/``, never a sandbox's record.

- ``backend``: ``VmBackend``: the contract, the one door from the sandbox layer to its VMs;
- ``factory``: ``VmFactory``: the libvirt backend: clone, cold boot, pool, hibernate, wake, fork, destroy;
- ``pool``: ``WarmPool``: ready clones per template;
- ``snapshots``: ``TemplateSnapshots``: one warmed-up VM frozen per template and shape;
- ``fork``: ``VmForker``: a live VM's RAM and devices become n children;
- ``spares``: ``Spares``: a ready copy of a forked template's RAM file, with paused QEMUs on it;
- ``prune``: stale template snapshots and guest image builds;
- ``saves``: ``CheckpointFiles``: a VM's state frozen, diffed against its template snapshot, zstd, loaded;
- ``launched``: ``Launched``: what a launch hands back (the fresh agent, the timings);
- ``cpu``: ``KeyPartitions``: each key's VMs in a CPU partition of their own (``hypervisor/cgroups.py``).
"""

from .backend import StateFiles, VmBackend
from .factory import VmFactory
from .launched import Launched
from .pool import Clone, WarmPool

__all__ = ["Clone", "Launched", "StateFiles", "VmBackend", "VmFactory", "WarmPool"]
