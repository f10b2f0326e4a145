"""Fixtures shared by the channel and execution unit tests: a scriptable fake guest agent on a
short UNIX socket path (``tests/unit/fake_agent.py``)."""

from __future__ import annotations

import os

import pytest

from .fake_agent import FakeAgent, short_socket_dir


@pytest.fixture
def sock_path():
    with short_socket_dir() as d:
        yield os.path.join(d, "agent.sock")


@pytest.fixture
async def agent(sock_path):
    fake = await FakeAgent(sock_path).start()
    yield fake
    await fake.stop()
