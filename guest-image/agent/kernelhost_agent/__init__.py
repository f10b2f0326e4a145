"""kernelhost guest agent.

Runs inside the VM (``python3 -m kernelhost_agent``, started by /sbin/kernelhost-init under
tini). It opens the virtio-serial port ``org.kernelhost.0``, starts ipykernel with
jupyter_client, relays Jupyter messages between the host and the kernel, and answers the host's
requests ``{"op": NAME, "id": N, ...}`` with ``{"op": "reply", "id": N, "ok": ...}``.

Only what the guest image has is used: Python 3, jupyter_client, pyzmq, msgpack (distribution
packages), and ``codec.py`` and ``protocol.py``, the host's own modules copied in by the image
build (see ``shared.py``).

Modules, by area:

- ``agent``: the wiring, and the ops every agent has (hello, ping, interrupt, restart)
- ``config``: ``AgentConfig``, every path and switch
- ``port``: the virtio-serial port's reader and writer threads
- ``dispatch``: the op table and the frame kinds; ``tasks``: owned background tasks
- ``kernel``: the ipykernel process; ``relay``: Jupyter messages both ways
- ``contexts``: code contexts, kernels of their own beside the main one (a ``kernel`` and a
  ``relay`` each), and the routing of the host's jupyter frames
- ``limits``: per-execution output caps and usage figures
- ``bash`` (with ``cgroups``), ``files``, ``network`` (with ``netproxy``), ``snapshot``
- ``shared``: ``codec``, ``protocol`` and the log
"""
