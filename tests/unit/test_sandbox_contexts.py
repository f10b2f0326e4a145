"""Code contexts (``sandboxes/inside/contexts.py``) on the fake VM backend, whose agents play the
guest's part (``GuestContexts``), and where E2B's ``/execute`` runs (``api/e2b/contexts.py``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kernelhost.api.e2b.contexts import target
from kernelhost.sandboxes.errors import ContextNotFound, InvalidRequest, NotSupportedByImage
from kernelhost.sandboxes.inside.contexts import CodeContexts
from kernelhost.sandboxes.sandbox import Sandbox

from .fake_agent import FakeAgent
from .fake_backend import House, open_house

pytestmark = pytest.mark.unit

KERNELS = [{"name": "kernelhost-python", "language": "python"}, {"name": "ir", "language": "R"}]


class GuestContexts:
    """The agent's context ops, in memory, for every VM of a house."""

    def __init__(self) -> None:
        self.contexts: dict[str, dict[str, Any]] = {}
        self.started: list[dict[str, Any]] = []

    def replies(self) -> dict[str, Any]:
        return {"context_start": self.start, "context_list": self.list, "context_stop": self.stop}

    async def start(self, fake: FakeAgent, frame: dict[str, Any]) -> None:
        self.started.append(frame)
        language = {k["name"]: k["language"].lower() for k in KERNELS}[frame["kernel"]]
        cid = f"ctx-{len(self.started):012x}"
        self.contexts[cid] = {
            "context": cid,
            "kernel": frame["kernel"],
            "language": language,
            "cwd": frame.get("cwd", "/home/user"),
            "default": frame.get("default") is True,
        }
        await fake.reply(frame, **self.contexts[cid])

    async def list(self, fake: FakeAgent, frame: dict[str, Any]) -> None:
        await fake.reply(frame, contexts=[*self.contexts.values(), {"context": 5}, "nonsense"])

    async def stop(self, fake: FakeAgent, frame: dict[str, Any]) -> None:
        self.contexts.pop(frame["context"])
        await fake.reply(frame)


@pytest.fixture
async def house(tmp_path: Path) -> AsyncIterator[tuple[House, GuestContexts, CodeContexts]]:
    guest = GuestContexts()
    async with open_house(tmp_path) as house:
        house.vms.hello = {"capabilities": ["contexts"], "kernels": KERNELS}
        house.vms.replies = guest.replies()
        yield house, guest, CodeContexts(house.ctx.settings, house.hibernation.wait_for_vm)


async def test_a_context_starts_on_the_kernelspec_of_its_language(house: Any) -> None:
    h, guest, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    assert contexts.kernels(sbx) == {"python": "kernelhost-python", "r": "ir"}
    made = await contexts.start(sbx, "R", "/tmp/r")
    assert (made.language, made.cwd, made.kernel, made.default) == ("r", "/tmp/r", "ir", False)
    assert guest.started[-1]["kernel"] == "ir" and guest.started[-1]["cwd"] == "/tmp/r"
    assert [c.id for c in await contexts.list(sbx)] == [made.id]  # the guest's nonsense dropped
    assert (await contexts.get(sbx, made.id)) == made


async def test_a_language_without_a_kernel_and_a_relative_cwd_are_refused(house: Any) -> None:
    h, guest, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    with pytest.raises(InvalidRequest, match=r"'julia' has no kernel .* it has python, r"):
        await contexts.start(sbx, "julia")
    with pytest.raises(InvalidRequest, match="absolute path"):
        await contexts.start(sbx, "python", "work")
    assert guest.started == []


async def test_a_languages_default_context_is_started_once_and_found_by_its_mark(house: Any) -> None:
    h, guest, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    await contexts.start(sbx, "r")  # not a default one
    first = await contexts.default_for(sbx, "r")
    assert first.default and guest.started[-1]["default"] is True
    assert await contexts.default_for(sbx, "R") == first
    assert len(guest.started) == 2


async def test_stop_forgets_and_an_unknown_context_is_not_found(house: Any) -> None:
    h, _, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    made = await contexts.start(sbx, "python")
    await contexts.stop(sbx, made.id)
    with pytest.raises(ContextNotFound, match=made.id):
        await contexts.stop(sbx, made.id)
    with pytest.raises(ContextNotFound):
        await contexts.restart(sbx, "ctx-nothing")
    assert not h.vm_of(sbx.id).agent.requests("context_restart")


async def test_stop_all_ends_every_context_and_an_old_image_has_none(house: Any) -> None:
    h, guest, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    for language in ("python", "r"):
        await contexts.start(sbx, language)
    assert await contexts.stop_all(sbx) == 2 and guest.contexts == {}
    h.vms.hello = {}
    assert await contexts.stop_all(await h.lifecycle.create("k", "python")) == 0


async def test_a_guest_refusal_is_said_and_an_old_image_is_named(house: Any) -> None:
    h, _, contexts = house
    sbx = await h.lifecycle.create("k", "python")
    h.vm_of(sbx.id).agent.replies["context_start"] = "error"
    with pytest.raises(InvalidRequest, match=r"refused context_start: .*fake agent refuses"):
        await contexts.start(sbx, "python")
    h.vms.hello = {}  # an image from before contexts
    old = await h.lifecycle.create("k", "python")
    with pytest.raises(NotSupportedByImage, match="without code contexts"):
        await contexts.list(old)


class Manager:
    """What ``target`` asks of the manager: the main kernel's language and the contexts."""

    def __init__(self, contexts: CodeContexts, main: str = "python") -> None:
        self.contexts = contexts
        self.main = main

    def template(self, owner: str, name: str) -> Any:
        return type("View", (), {"language": self.main})()


async def test_where_an_e2b_execute_runs(house: Any) -> None:
    h, _, contexts = house
    sbx: Sandbox = await h.lifecycle.create("k", "python")
    manager: Any = Manager(contexts)
    assert await target(manager, sbx, None, None) == ("python", None)
    assert await target(manager, sbx, "Python", None) == ("python", None)
    assert await target(manager, sbx, "sh", None) == ("bash", None)
    assert await target(manager, sbx, None, "bash") == ("bash", None)
    assert await target(manager, sbx, None, "python") == ("python", None)  # the main kernel's id
    language, r_default = await target(manager, sbx, "r", None)
    assert language == "python" and r_default is not None  # a kernel: R's default context
    assert await target(manager, sbx, None, r_default) == ("python", r_default)
    with pytest.raises(ContextNotFound):
        await target(manager, sbx, None, "ctx-gone")
    with pytest.raises(InvalidRequest, match="Only one of context_id or language"):
        await target(manager, sbx, "python", r_default)
    r_main: Any = Manager(contexts, main="r")  # the r template: R is the main kernel
    assert await target(r_main, sbx, "r", None) == ("python", None)
