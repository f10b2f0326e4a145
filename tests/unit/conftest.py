"""Fixtures shared by the unit tests: a scriptable fake guest agent on a short UNIX socket path
(``tests/unit/fake_agent.py``); the SDK's fake kernelhost server (``client_fake.py``: ``fake``,
``threaded_fake``); for the store's tests, a throwaway PostgreSQL server
(``tests/pg.py``; started once, by the first test that asks for it) and ``db``, a fresh database
on each backend."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kernelhost.sandboxes.store.db import Database, PostgreSQL, SQLite
from tests.pg import PostgresServer, running_postgres

from .client_fake import fake, no_env, sdk_thread_baseline, threaded_fake
from .fake_agent import FakeAgent, short_socket_dir

#: the SDK's fake kernelhost server and its fixtures (tests/unit/client_fake.py)
__all__ = ["fake", "no_env", "sdk_thread_baseline", "threaded_fake"]


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


_databases = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh, empty database, SQLite and PostgreSQL (the server starts only for the tests
    that use it)."""
    database: Database
    if request.param == "sqlite":
        database = SQLite(tmp_path / "kernelhost.db")
    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        database = PostgreSQL(server.new_database(f"t_{next(_databases)}"))
    try:
        yield database
    finally:
        database.close()


@pytest.fixture
def sock_path():
    with short_socket_dir() as d:
        yield os.path.join(d, "agent.sock")


@pytest.fixture
async def agent(sock_path):
    fake = await FakeAgent(sock_path).start()
    yield fake
    await fake.stop()
