"""The service's database and the tables the sandbox layer keeps in it.

- ``db``: ``Database``: SQLite (the default) and PostgreSQL (a cluster's store), one SQL dialect;
- ``sandboxes``: ``SandboxRecord``, ``Store``: sandbox records, schema, migrations, API key ids;
- ``checkpoints``: ``CheckpointRecord``, ``CheckpointStore``: checkpoint records;
- ``templates``: ``TemplateRecord``, ``TemplateStore``: template and build records.

The cluster's tables are in ``cluster/`` (``node_table.py``, ``quota.py``).
"""

from .checkpoints import CheckpointRecord, CheckpointStore
from .db import Database, StoreUnavailable, open_database
from .sandboxes import SandboxRecord, Store
from .templates import TemplateRecord, TemplateStore

__all__ = [
    "CheckpointRecord",
    "CheckpointStore",
    "Database",
    "SandboxRecord",
    "Store",
    "StoreUnavailable",
    "TemplateRecord",
    "TemplateStore",
    "open_database",
]
