"""The native REST API (``/v1``), a surface beside ``gateway/`` and ``e2b/``.

- ``routes``: sandboxes (create, list, get, delete, execute, files, fork, hibernate, interrupt,
  restart), ``/healthz`` and ``/metrics``;
- ``checkpoints``: ``/v1/sandboxes/{id}/checkpoints``, ``/restore``, ``/undo``;
- ``templates``: ``/v1/templates``: build, list, get, logs, cancel, delete;
- ``requests``: what the views share to read a request (``field``, ``runtime``, ``sandbox``);
- ``usage``: a sandbox's samples (``/v1/sandboxes/{id}/metrics``), ``/metrics/sandboxes``;
- ``ndjson``: the lines of an execution's NDJSON stream;
- ``openapi``, ``openapi_checkpoints``, ``openapi_templates``: ``/openapi.json``.
"""
