"""Jupyter tools on kernelhost: a kernel provisioner and the Kernel Gateway WebSocket framings.

- ``provisioner``: ``KernelhostProvisioner``, the jupyter_client kernel provisioner (entry point
  ``kernelhost-provisioner``) that runs a kernel in a kernelhost sandbox, for nbclient,
  papermill, ``jupyter nbconvert --execute``, ``jupyter console`` and a local jupyter_server;
- ``bridge``: the local process it starts, which serves the kernel's ZeroMQ sockets on
  127.0.0.1 and relays them to the service's Kernel Gateway WebSocket;
- ``kernelspec``: what ``kernelhost kernelspec install`` writes;
- ``workdir``: what a provisioned kernel takes from the machine that starts it (the variables
  and files the user names) and the silent cell that sets them up in the kernel;
- ``wire``: the WebSocket framings, shared with the service's gateway (pure, no I/O).

Like the SDK, this speaks HTTP only and imports nothing of the server. Importing this package
loads nothing; each module imports what it needs.
"""
