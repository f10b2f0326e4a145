"""The provisioner's pieces that need no service."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kernelhost.jupyter.provisioner import KernelhostError, KernelhostProvisioner, in_thread

pytestmark = pytest.mark.unit


async def test_in_thread_returns_and_raises_what_the_function_does() -> None:
    assert await in_thread(int, "7") == 7
    with pytest.raises(ValueError):
        await in_thread(int, "seven")


def test_in_thread_works_in_a_process_forked_from_one_whose_loop_used_threads() -> None:
    # nbclient's test_many_parallel_notebooks: a ProcessPoolExecutor forks the process after a
    # kernel ran, and the child reuses jupyter_client's event loop; asyncio.to_thread there waits
    # forever on the default executor's threads, which the fork did not copy
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.to_thread(int))  # the default executor has a thread
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the call came back
            try:
                done = loop.run_until_complete(asyncio.wait_for(in_thread(int, "7"), 10))
                os._exit(0 if done == 7 else 1)
            except BaseException:
                os._exit(2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        loop.close()


async def test_a_call_the_service_never_answers_names_the_wait_and_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()  # accepts, never answers
    try:
        monkeypatch.setenv("KERNELHOST_API_KEY", "k")
        provisioner = KernelhostProvisioner(url=f"http://127.0.0.1:{server.getsockname()[1]}")
        provisioner.launch_timeout = 0.5
        with pytest.raises(
            KernelhostError, match=r"did not answer POST /api/kernels within 0.5s.*launch_timeout"
        ):
            await provisioner._call("POST", "/api/kernels", {}, timeout=provisioner.launch_timeout)
    finally:
        server.close()
