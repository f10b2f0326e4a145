"""Fixtures shared by the unit tests: a scriptable fake guest agent on a short UNIX socket path
(``tests/unit/fake_agent.py``), and a throwaway PostgreSQL server for the store's tests
(``tests/pg.py``; started once, by the first test that asks for it)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.pg import PostgresServer, running_postgres

from .fake_agent import FakeAgent, short_socket_dir


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as server:
        yield server


@pytest.fixture
def sock_path():
    with short_socket_dir() as d:
        yield os.path.join(d, "agent.sock")


@pytest.fixture
async def agent(sock_path):
    fake = await FakeAgent(sock_path).start()
    yield fake
    await fake.stop()
