"""The service's database and the tables the sandbox layer keeps in it.

- ``db``: ``Database``: SQLite (the default) and PostgreSQL (a cluster's store), one SQL dialect;
- ``migrations``: ``migrate()``: the schema's versions, applied once each under the schema's lock;
- ``schema``: schema version 1, every table as the releases before versioned migrations made it;
- ``sandboxes``: ``SandboxRecord``, ``Store``: sandbox records, and the cluster's queries on them;
  ``open_store``: the store as the service's start-up opens it (``api/app.py``, by this face);
- ``checkpoints``: ``CheckpointRecord``, ``CheckpointStore``: checkpoint records;
- ``templates``: ``TemplateRecord``, ``TemplateStore``: template and build records.

The cluster's tables (``nodes``, ``reservations``) are made here too; ``cluster/`` reads and
writes them (``node_table.py``, ``quota.py``), and asks ``Store`` about the sandboxes table.
"""

from .checkpoints import CheckpointRecord, CheckpointStore
from .db import Database, StoreUnavailable, open_database
from .migrations import Migration, Outcome, SchemaTooNew, migrate
from .sandboxes import SandboxRecord, Store, open_store
from .templates import TemplateRecord, TemplateStore

__all__ = [
    "CheckpointRecord",
    "CheckpointStore",
    "Database",
    "Migration",
    "Outcome",
    "SandboxRecord",
    "SchemaTooNew",
    "Store",
    "StoreUnavailable",
    "TemplateRecord",
    "TemplateStore",
    "migrate",
    "open_database",
    "open_store",
]
