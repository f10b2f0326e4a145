"""The service's JSON log: every line about a sandbox names it and its API key's id, and no
line carries an API key itself: every line of a request is bound to its sandbox id and key id,
never to the key."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kernelhost import AsyncSandbox
from kernelhost.api.auth import key_id

from ..harness import Service

pytestmark = pytest.mark.vm


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for raw in text.splitlines():
        if raw.startswith("{"):
            lines.append(json.loads(raw))
    return lines


async def test_log_lines_are_bound_to_sandbox_and_key_and_never_hold_the_key(client_env: Service) -> None:
    start = client_env.log_path.stat().st_size
    sbx = await AsyncSandbox.create(template="python")
    sandbox_id = sbx.id
    try:
        assert (await sbx.run_code("print(6 * 7)")).stdout == "42\n"
        await sbx.files.write("note.txt", "hello")
        assert await sbx.files.read_text("note.txt") == "hello"
        assert (await sbx.run_code("echo hi", language="bash")).stdout == "hi\n"
        await sbx.interrupt()
    finally:
        await sbx.close()
    await asyncio.sleep(1.0)  # lines logged just after the DELETE answered (VM teardown)
    with client_env.log_path.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    whole = client_env.log_path.read_text(errors="replace")
    for key in (client_env.api_key, client_env.other_key):
        assert key not in whole, "an API key appears in the service log"

    lines = _json_lines(text)
    created = [
        ln for ln in lines if ln.get("event") == "sandbox.created" and ln.get("sandbox_id") == sandbox_id
    ]
    assert len(created) == 1, f"no sandbox.created line for {sandbox_id}: {lines[-20:]}"
    domain = created[0].get("domain")
    assert domain
    about = [ln for ln in lines if sandbox_id in json.dumps(ln) or (domain and domain in json.dumps(ln))]
    events = {ln.get("event") for ln in about}
    assert {"sandbox.created", "sandbox.removed"} <= events, events
    kid = key_id(client_env.api_key)
    unbound = [ln for ln in about if ln.get("sandbox_id") != sandbox_id or ln.get("key_id") != kid]
    assert not unbound, f"log lines about {sandbox_id} not bound to it and to {kid}: {unbound}"
