"""The service's database: one interface, two implementations.

``SQLite`` (the default: one file in the state directory, WAL) and ``PostgreSQL``
(``store_url = "postgresql://..."``: the store a cluster's nodes share; docs/cluster.md). The
stores above write their SQL once, in the dialect both understand: ``?`` and ``:name``
placeholders, ``INSERT ... ON CONFLICT``, and schemas with ``TEXT``, ``INTEGER`` and ``REAL``
columns (on PostgreSQL, ``BIGINT`` and ``DOUBLE PRECISION``: a byte count or a timestamp keeps its
precision). Statements are short and run inline; ``transaction()`` groups some atomically.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import BackendUnavailable

Params = Sequence[Any] | Mapping[str, Any]

# A quoted literal, a named placeholder, a positional one, or a literal percent sign.
_TOKENS = re.compile(r"'(?:[^']|'')*'|(?<!:):(\w+)|\?|%")
_TYPES = {"INTEGER": "BIGINT", "REAL": "DOUBLE PRECISION"}
_TYPE_WORDS = re.compile(r"\b(INTEGER|REAL)\b")
# PostgreSQL's advisory lock key of the schema ("kh_schem"): outside hashtext()'s 32-bit range,
# so no per-key lock of cluster/quota.py can take it
SCHEMA_LOCK = 0x6B685F736368656D


class StoreUnavailable(BackendUnavailable):
    """The database cannot be opened or reached; the message names the URL's host and the fix."""


class Database:
    """What the stores need of a database; ``dialect`` is ``sqlite`` or ``postgresql``."""

    dialect = ""
    now = ""  # the database's clock, in seconds since the epoch: every node reads the same one

    def __init__(self) -> None:
        self._lock = threading.RLock()  # one statement or transaction at a time on the connection
        self.schema_version = 0  # what migrations.py found or made on this connection; 0: not yet

    def execute(self, sql: str, params: Params = ()) -> list[dict[str, Any]]:
        with self._lock:
            return self._run(sql, params)

    def one(self, sql: str, params: Params = ()) -> dict[str, Any] | None:
        rows = self.execute(sql, params)
        return rows[0] if rows else None

    def scalar(self, sql: str, params: Params = ()) -> Any:
        row = self.one(sql, params)
        return next(iter(row.values())) if row else None

    def script(self, schema: str) -> None:
        """Create tables and indexes (``IF NOT EXISTS``): one statement per ``;``."""
        with self.transaction():
            for statement in schema.split(";"):
                if statement.strip():
                    self._run(self._ddl(statement), ())

    def add_columns(self, table: str, columns: Mapping[str, str]) -> None:
        """Add the ``columns`` (name -> definition) that ``table`` lacks."""
        with self.transaction():
            have = self.columns(table)
            for name, definition in columns.items():
                if name not in have:
                    self._run(self._ddl(f"ALTER TABLE {table} ADD COLUMN {name} {definition}"), ())

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        with self._lock, self._transaction():
            yield self

    def _ddl(self, statement: str) -> str:
        return statement

    def lock_schema(self) -> None:
        """Inside ``transaction()``: hold the schema's lock until it ends, so that one connection
        at a time, on any node, reads and changes the schema (``migrations.py``)."""
        raise NotImplementedError

    def columns(self, table: str) -> set[str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _run(self, sql: str, params: Params) -> list[dict[str, Any]]:
        raise NotImplementedError

    def _transaction(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError


class SQLite(Database):
    dialect = "sqlite"
    now = "((julianday('now') - 2440587.5) * 86400.0)"

    def __init__(self, path: Path) -> None:
        super().__init__()
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.conn.row_factory = sqlite3.Row
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self._depth = 0

    def _run(self, sql: str, params: Params) -> list[dict[str, Any]]:
        return [dict(row) for row in self.conn.execute(sql, params)]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self._depth:  # nested: part of the outer one
            yield
            return
        self.conn.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        else:
            self.conn.execute("COMMIT")
        finally:
            self._depth -= 1

    def lock_schema(self) -> None:
        """The transaction began with ``BEGIN IMMEDIATE``: it holds the file's write lock already
        (another connection waits for it, up to the busy timeout)."""
        assert self._depth, "lock_schema() runs inside transaction()"

    def columns(self, table: str) -> set[str]:
        return {row["name"] for row in self._run(f"PRAGMA table_info({table})", ())}

    def close(self) -> None:
        self.conn.close()


class PostgreSQL(Database):
    dialect = "postgresql"
    now = "EXTRACT(EPOCH FROM clock_timestamp())::float8"

    def __init__(self, url: str, *, connect_timeout: float = 10.0) -> None:
        super().__init__()
        import psycopg
        from psycopg.rows import dict_row

        self.url = url
        self._psycopg = psycopg

        def connect() -> Any:
            return psycopg.connect(
                url, autocommit=True, row_factory=dict_row, connect_timeout=max(1, int(connect_timeout))
            )

        self._connect = connect
        self.conn = self._reconnect()
        self._depth = 0

    def _reconnect(self) -> Any:
        try:
            return self._connect()
        except self._psycopg.Error as exc:
            raise StoreUnavailable(
                f"cannot reach the PostgreSQL store at {redact(self.url)}: {str(exc).strip()}; "
                "check store_url (KERNELHOST_STORE_URL) and that the server accepts this node"
            ) from None

    def _run(self, sql: str, params: Params) -> list[dict[str, Any]]:
        if self.conn.closed and not self._depth:  # the server restarted or dropped us: once more
            self.conn = self._reconnect()
        # without parameters psycopg sends the text as it is: a '%' must not be doubled then
        query = to_pyformat(sql) if params else sql
        try:
            cur = self.conn.execute(query, params or None)
        except self._psycopg.OperationalError:
            if self._depth or not self.conn.closed:
                raise
            self.conn = self._reconnect()
            cur = self.conn.execute(query, params or None)
        return list(cur.fetchall()) if cur.description else []

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        if self.conn.closed and not self._depth:
            self.conn = self._reconnect()
        self._depth += 1
        try:
            with self.conn.transaction():
                yield
        finally:
            self._depth -= 1

    def _ddl(self, statement: str) -> str:
        return _TYPE_WORDS.sub(lambda m: _TYPES[m.group(1)], statement)

    def lock_schema(self) -> None:
        """A transaction-scoped advisory lock with a fixed key: concurrent ``CREATE TABLE IF NOT
        EXISTS`` is not safe in PostgreSQL (two creators collide on the catalog's unique index),
        so every node waits for this lock before it reads or changes the schema."""
        assert self._depth, "lock_schema() runs inside transaction()"
        self._run("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))

    def columns(self, table: str) -> set[str]:
        rows = self._run(
            "SELECT column_name FROM information_schema.columns WHERE table_name = ? "
            "AND table_schema = current_schema()",
            (table,),
        )
        return {row["column_name"] for row in rows}

    def close(self) -> None:
        self.conn.close()


def to_pyformat(sql: str) -> str:
    """``?`` and ``:name`` placeholders as psycopg's ``%s`` and ``%(name)s``; literals untouched."""

    def swap(m: re.Match[str]) -> str:
        token = m.group(0)
        if token.startswith("'"):
            return token.replace("%", "%%")
        if token == "?":
            return "%s"
        if token == "%":
            return "%%"
        return f"%({m.group(1)})s"

    return _TOKENS.sub(swap, sql)


def redact(url: str) -> str:
    """A store URL without its password, for messages and logs."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def open_database(store_url: str, default_path: Path) -> Database:
    """The database ``store_url`` names (``postgresql://`` or ``sqlite:///path``), or the SQLite
    file ``default_path`` when it is empty."""
    if not store_url:
        return SQLite(default_path)
    if store_url.startswith(("postgresql://", "postgres://")):
        return PostgreSQL(store_url)
    if store_url.startswith("sqlite:///"):
        return SQLite(Path(store_url.removeprefix("sqlite://")))
    raise StoreUnavailable(
        f"store_url has value {redact(store_url)!r}; use postgresql://user:password@host/db, "
        "sqlite:///path, or leave it empty for the state directory's SQLite file"
    )
