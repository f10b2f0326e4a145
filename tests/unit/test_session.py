"""Co-attach without a VM: the session of one sandbox's Jupyter clients, on a fake agent:
routing of replies, the lease of the execution lock, restarts and removal."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from kernelhost.channel import AgentClient
from kernelhost.sandboxes import Sandbox, SandboxRecord, SandboxState, SessionEnd
from kernelhost.sandboxes.registry import Quota, Registry
from kernelhost.sandboxes.session import KernelSession, Sessions
from kernelhost.sandboxes.store import Store
from kernelhost.tasks import TaskSet

from .fake_agent import WAIT, FakeAgent, short_socket_dir, stream

pytestmark = pytest.mark.unit


def _msg(msg_type: str = "execute_request", **content: Any) -> dict[str, Any]:
    return {
        "header": {
            "msg_id": uuid.uuid4().hex,
            "msg_type": msg_type,
            "session": "s",
            "username": "u",
            "version": "5.3",
            "date": "2026-01-01T00:00:00Z",
        },
        "parent_header": {},
        "metadata": {"m": 1},
        "content": content or {"code": "1"},
        "buffers": [b"\x00\x01", b"buf"],
    }


class FakeClient:
    """A SessionClient that records what it is given."""

    def __init__(self) -> None:
        self.got: list[tuple[str, dict[str, Any]]] = []
        self.ended: SessionEnd | None = None

    def deliver(self, channel: str, msg: dict[str, Any], cache: dict[Any, Any]) -> None:
        self.got.append((channel, msg))

    def end(self, why: SessionEnd) -> None:
        self.ended = why

    def types(self, channel: str | None = None) -> list[str]:
        return [m["header"]["msg_type"] for c, m in self.got if channel in (None, c)]


async def _no_wake(sbx: Sandbox) -> None:
    return None


@pytest.fixture
async def session_setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    with short_socket_dir() as d:
        fake = await FakeAgent(f"{d}/agent.sock").start()
        agent = AgentClient(f"{d}/agent.sock")
        await agent.connect(timeout=WAIT)
        now = time.time()
        store = Store(tmp_path / "db.sqlite3")
        registry = Registry(store, Quota(10, 10_000))
        sbx = Sandbox(
            SandboxRecord(
                "sbx_1", "key", "python", "dom", SandboxState.RUNNING, now, now, 600, 512, 1, "tcg", "k"
            )
        )
        store.insert(sbx.record)
        sbx.agent = agent
        registry.add(sbx)
        tasks = TaskSet("test-sessions")
        sessions = Sessions(registry, _no_wake, send_timeout=WAIT, tasks=tasks)
        session = sessions.open(sbx)
        a, b = FakeClient(), FakeClient()
        session.attach(a)
        session.attach(b)
        try:
            yield fake, sbx, session, a, b, registry
        finally:
            await tasks.close(timeout=WAIT)
            await agent.close()
            await fake.stop()
            store.close()


async def _until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + WAIT
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, what
        await asyncio.sleep(0.01)


async def test_replies_go_to_the_sender_and_iopub_to_everyone(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, session, a, b, _ = session_setup
    request = _msg(code="print('hi')")
    await session.send_shell(a, request)
    assert sbx.lock.locked() and session.holding  # a native execute waits for this cell
    request_seen = await fake.wait_for_execute()
    await fake.run_execute(request_seen, [stream("hi\n")])
    await _until(lambda: "execute_reply" in a.types(), "the reply")
    assert a.types("iopub") == b.types("iopub") == ["status", "execute_input", "stream", "status"]
    assert "execute_reply" not in b.types()
    await _until(lambda: not sbx.lock.locked(), "the lock given back")
    assert session.outstanding == set() and not session.holding
    # the buffers of the request went to the agent as they were
    assert request_seen["buffers"] == [b"\x00\x01", b"buf"]


async def test_client_cells_queue_in_the_kernel_under_one_lease(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, session, a, b, _ = session_setup
    first, second = _msg(code="1"), _msg(code="2")
    await session.send_shell(a, first)
    await session.send_shell(b, second)  # not blocked: the session already holds the lease
    assert session.outstanding == {first["header"]["msg_id"], second["header"]["msg_id"]}
    assert sbx.lock.holder is not None and sbx.lock.holder.startswith("kernel-session")
    await fake.wait_until(lambda: len(fake.requests("jupyter")) == 2)
    one, two = (f["msg"] for f in fake.requests("jupyter"))
    await fake.run_execute(one)
    await _until(lambda: len(session.outstanding) == 1, "the first cell done")
    assert sbx.lock.locked()
    await fake.run_execute(two)
    await _until(lambda: not sbx.lock.locked(), "the lock given back")


async def test_a_client_cell_waits_for_a_native_call(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, session, a, _, _ = session_setup
    native = sbx.lock.hold("execute")
    await native.__aenter__()  # a native execute runs
    sending = asyncio.ensure_future(session.send_shell(a, _msg(code="1")))
    await asyncio.sleep(0.05)
    assert not sending.done() and fake.requests("jupyter") == []
    await native.__aexit__(None, None, None)
    await asyncio.wait_for(sending, WAIT)
    assert session.holding
    await fake.wait_until(lambda: len(fake.requests("jupyter")) == 1)


async def test_restarts_release_the_lock_and_tell_the_clients(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, sbx, session, a, b, _ = session_setup
    await session.send_shell(a, _msg(code="import time; time.sleep(100)"))
    assert sbx.lock.locked()
    await fake.event("kernel_restarted", reason="requested")  # the SDK restarted it
    await _until(lambda: not sbx.lock.locked(), "the lock given back")
    for client in (a, b):
        assert client.got[-1][1]["content"] == {"execution_state": "restarting"}
    # a restart asked through the gateway's REST API is not announced (clients reconnect)
    session.quiet_restart = True
    await fake.event("kernel_restarted", reason="requested")
    await fake.event("kernel_died", exit_code=1)  # ... a death always is
    await _until(lambda: len(a.got) == 2, "the death announced")


async def test_removal_ends_the_clients(session_setup) -> None:  # type: ignore[no-untyped-def]
    _, sbx, session, a, b, registry = session_setup
    registry.pop(sbx)
    assert sbx.agent is not None
    await sbx.agent.close()
    assert a.ended == b.ended == SessionEnd(True, "the sandbox was deleted")
    assert a.got[-1][1]["content"] == {"execution_state": "dead"}
    session.detach(a)
    session.detach(b)
    assert sbx.kernel is None


async def test_a_wrong_lease_release_is_a_bug_that_shows(session_setup) -> None:  # type: ignore[no-untyped-def]
    _, sbx, session, a, _, _ = session_setup
    await session.send_shell(a, _msg(code="1"))
    with pytest.raises(RuntimeError, match="held by kernel-session"):
        sbx.lock.end_lease("someone else")
    assert isinstance(sbx.kernel, KernelSession) and sbx.lock.locked()
    session.drop_outstanding()
    assert not sbx.lock.locked()


def _debug(command: str, **arguments: Any) -> dict[str, Any]:
    return _msg("debug_request", type="request", seq=1, command=command, arguments=arguments)


def _debug_sent(fake: FakeAgent) -> list[str]:
    return [
        f["msg"]["content"]["command"]
        for f in fake.requests("jupyter")
        if f["channel"] == "control" and f["msg"]["header"]["msg_type"] == "debug_request"
    ]


async def test_a_debugger_ends_when_the_last_client_that_attached_it_leaves(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, _, session, a, b, _reg = session_setup
    await session.send(a, "control", _debug("initialize"))
    await session.send(a, "control", _debug("attach"))
    await session.send(b, "control", _debug("attach"))  # a second debugging client (two tabs)
    await fake.wait_until(lambda: len(_debug_sent(fake)) == 3)
    session.detach(a)
    await asyncio.sleep(0.2)
    assert _debug_sent(fake) == ["initialize", "attach", "attach"]  # b still debugs
    session.detach(b)
    await fake.wait_until(lambda: len(_debug_sent(fake)) == 4)
    last = fake.requests("jupyter")[-1]["msg"]
    assert last["content"]["command"] == "disconnect"
    assert last["content"]["arguments"] == {"restart": False, "terminateDebuggee": False}


async def test_a_debugger_its_client_disconnected_is_not_disconnected_again(session_setup) -> None:  # type: ignore[no-untyped-def]
    fake, _, session, a, b, _reg = session_setup
    await session.send(a, "control", _debug("attach"))
    await session.send(a, "control", _debug("disconnect", restart=False, terminateDebuggee=True))
    session.detach(a)
    session.detach(b)  # b never debugged
    await asyncio.sleep(0.2)
    assert _debug_sent(fake) == ["attach", "disconnect"]
