"""Unit tests of the Python SDK (``kernelhost.client``) against a fake kernelhost server
(``client_fake.py``): its public surface, configuration, lifecycle and error mapping;
``test_client_run_code.py`` has ``run_code`` and the sync twin."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys
import types

import pytest

import kernelhost
from kernelhost import (
    APIError,
    AsyncSandbox,
    AuthenticationError,
    ConflictError,
    Execution,
    ExecutionError,
    InvalidRequestError,
    KernelHostError,
    KernelHostTimeout,
    NotFoundError,
    RateLimitError,
    Result,
    Sandbox,
    SandboxInfo,
    ServerError,
    TransportError,
)

from .client_fake import KEY, REPO, FakeKernelHost, _closed_port_url, _sdk_threads

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("no_env", "sdk_thread_baseline")]


# -- public surface ------------------------------------------------------------------------


def test_all_lists_exactly_the_public_names() -> None:
    expected = {
        "APIError", "AsyncFiles", "AsyncSandbox", "AsyncTemplate", "AuthenticationError", "BuildInfo",
        "Checkpoint",
        "ConflictError", "Template", "TemplateBuildError", "TemplateInfo",
        "Execution", "ExecutionError", "ExecutionStatus", "FileInfo", "FileTooLargeError", "Files",
        "InvalidRequestError", "KernelHostError", "KernelHostTimeout", "NotFoundError",
        "RateLimitError", "Recovery", "Result", "Sandbox", "SandboxInfo", "SandboxMetrics", "SandboxState",
        "ServerError", "TransportError",
    }  # fmt: skip
    assert set(kernelhost.__all__) == expected
    assert kernelhost.__all__ == sorted(kernelhost.__all__)
    assert kernelhost.client.__all__ == kernelhost.__all__
    # submodules (kernelhost.client, and server modules other tests import) are not API names
    public = {
        name
        for name, value in vars(kernelhost).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert public == expected


def test_importing_kernelhost_loads_no_server_code() -> None:
    code = (
        "import json, sys, kernelhost\n"
        "banned = ('kernelhost.api', 'kernelhost.sandboxes', 'kernelhost.channel', 'hypervisor',"
        " 'libvirt', 'jupyter_client', 'aiohttp.web')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith(banned))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == []


def test_exception_tree() -> None:
    for cls in (AuthenticationError, InvalidRequestError, NotFoundError, ConflictError,
                RateLimitError, ServerError):  # fmt: skip
        assert issubclass(cls, APIError)
    assert issubclass(APIError, KernelHostError)
    assert issubclass(TransportError, KernelHostError)
    assert issubclass(KernelHostTimeout, KernelHostError)
    assert issubclass(KernelHostTimeout, TimeoutError)


def test_sync_methods_take_signature_and_docstring_from_async() -> None:
    for name in ("run_code", "info", "interrupt", "restart"):
        sync, async_ = getattr(Sandbox, name), getattr(AsyncSandbox, name)
        assert sync.__doc__ == async_.__doc__, name
        assert inspect.signature(sync) == inspect.signature(async_), name
        assert not inspect.iscoroutinefunction(sync), name
    for name in ("close", "detach", "connect", "list"):
        assert getattr(Sandbox, name).__doc__ == getattr(AsyncSandbox, name).__doc__, name


def test_models() -> None:
    main = Result(data={"text/plain": "2", "text/html": "<b>2</b>"}, is_main_result=True)
    shown = Result(data={"image/png": "iVBO", "application/json": {"a": 1}})
    assert (main.text, main.html, main.png, main.markdown) == ("2", "<b>2</b>", None, None)
    assert (shown.png, shown.json, shown.jpeg, shown.svg) == ("iVBO", {"a": 1}, None, None)
    assert main.formats() == ["text/plain", "text/html"]
    assert Execution(results=[shown, main]).text == "2"
    assert Execution(results=[shown]).text is None
    error = ExecutionError(name="ZeroDivisionError", value="division by zero", traceback=["tb"])
    assert str(error) == "ZeroDivisionError: division by zero"


# -- configuration ---------------------------------------------------------------------------


async def test_missing_api_key_fails_before_any_request(fake: FakeKernelHost) -> None:
    with pytest.raises(AuthenticationError) as info:
        await AsyncSandbox.create(url=fake.url)
    message = str(info.value)
    assert "api_key=" in message and "KERNELHOST_API_KEY" in message
    assert "kernelhost serve" in message
    with pytest.raises(AuthenticationError):
        await AsyncSandbox.list(url=fake.url)
    with pytest.raises(AuthenticationError):
        AsyncSandbox(url=fake.url)
    assert fake.requests == []


async def test_url_and_key_come_from_the_environment(
    fake: FakeKernelHost, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KERNELHOST_URL", fake.url + "/")
    monkeypatch.setenv("KERNELHOST_API_KEY", KEY)
    async with AsyncSandbox() as sbx:
        assert sbx.id == "sbx_1"
    assert fake.headers[0]["Authorization"] == f"Bearer {KEY}"


def test_bad_url_names_the_value() -> None:
    with pytest.raises(ValueError, match="'localhost:8999'"):
        AsyncSandbox(url="localhost:8999", api_key=KEY)


async def test_wrong_key_is_an_authentication_error(fake: FakeKernelHost) -> None:
    with pytest.raises(AuthenticationError) as info:
        await AsyncSandbox.create(url=fake.url, api_key="wrong")
    assert info.value.status == 401
    assert info.value.code == "invalid_api_key"
    assert "KERNELHOST_API_KEY" in str(info.value)


async def test_server_down_is_a_transport_error() -> None:
    url = _closed_port_url()
    with pytest.raises(TransportError) as info:
        await AsyncSandbox.create(url=url, api_key=KEY)
    assert url in str(info.value)
    assert "make serve" in str(info.value) and "KERNELHOST_URL" in str(info.value)


# -- lifecycle -------------------------------------------------------------------------------


async def test_async_with_creates_then_deletes(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(
        url=fake.url, api_key=KEY, metadata={"owner": "me"}, idle_timeout_seconds=60
    ) as sbx:
        assert sbx.id == "sbx_1"
        info = await sbx.info()
    assert fake.requests[0] == (
        "POST",
        "/v1/sandboxes",
        {"template": "python", "metadata": {"owner": "me"}, "idle_timeout_seconds": 60},
    )
    assert info.metadata == {"owner": "me"} and info.idle_timeout_seconds == 60
    assert info.created_at is not None and info.created_at.tzinfo is not None
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]
    assert fake.sandboxes == {}


async def test_create_omits_unset_idle_timeout(fake: FakeKernelHost) -> None:
    async with await AsyncSandbox.create(url=fake.url, api_key=KEY) as sbx:
        assert sbx.id == "sbx_1"
    assert fake.requests[0][2] == {"template": "python", "metadata": {}}
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_close_is_idempotent_and_blocks_further_use(fake: FakeKernelHost) -> None:
    sbx = await AsyncSandbox.create(url=fake.url, api_key=KEY)
    await sbx.close()
    await sbx.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]
    with pytest.raises(KernelHostError, match="sandbox sbx_1 is closed"):
        await sbx.run_code("1")
    with pytest.raises(KernelHostError, match="is closed"):
        async with sbx:
            pass


async def test_detach_keeps_the_sandbox_and_retires_the_handle(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        await sbx.detach()
        await sbx.detach()  # idempotent
        assert sbx.id == "sbx_1" and "detached" in repr(sbx)
        with pytest.raises(KernelHostError, match=r"sbx_1 was detached .*connect\('sbx_1'\)"):
            await sbx.run_code("1")
        with pytest.raises(KernelHostError, match="was detached"):
            await sbx.files.read("x")
        await sbx.close()  # not this handle's to delete any more
    # neither close() nor the block's exit deleted it: another handle still can use it
    assert fake.calls("DELETE") == [] and "sbx_1" in fake.sandboxes
    again = await AsyncSandbox.connect("sbx_1", url=fake.url, api_key=KEY)
    assert (await again.run_code("1")).text == "2"
    await again.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


def test_sync_detach_keeps_the_sandbox(threaded_fake: FakeKernelHost) -> None:
    with Sandbox(url=threaded_fake.url, api_key=KEY) as sbx:
        sbx.detach()
        assert _sdk_threads() == []  # the handle's loop thread is gone
        with pytest.raises(KernelHostError, match="was detached"):
            sbx.run_code("1")
        sbx.detach()
    assert threaded_fake.calls("DELETE") == []
    with Sandbox.connect("sbx_1", url=threaded_fake.url, api_key=KEY) as again:
        assert again.run_code("1").text == "2"
    assert threaded_fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_close_tolerates_a_sandbox_already_gone(fake: FakeKernelHost) -> None:
    sbx = await AsyncSandbox.create(url=fake.url, api_key=KEY)
    fake.sandboxes.clear()  # the idle reaper got there first
    await sbx.close()
    assert fake.calls("DELETE") == ["/v1/sandboxes/sbx_1"]


async def test_unopened_sandbox_says_how_to_create_it() -> None:
    sbx = AsyncSandbox(url="http://127.0.0.1:1", api_key=KEY)
    with pytest.raises(KernelHostError, match="not been created yet"):
        await sbx.run_code("1")


async def test_connect_list_interrupt_restart(fake: FakeKernelHost) -> None:
    first = await AsyncSandbox.create(url=fake.url, api_key=KEY, metadata={"n": "1"})
    try:
        listed = await AsyncSandbox.list(url=fake.url, api_key=KEY)
        assert [s.id for s in listed] == ["sbx_1"] and isinstance(listed[0], SandboxInfo)
        again = await AsyncSandbox.connect("sbx_1", url=fake.url, api_key=KEY)
        assert again.id == "sbx_1"
        await again.interrupt()
        await again.restart()
        assert (await again.run_code("1")).text == "2"
        assert fake.calls("POST")[-3:] == [
            "/v1/sandboxes/sbx_1/interrupt",
            "/v1/sandboxes/sbx_1/restart",
            "/v1/sandboxes/sbx_1/execute",
        ]
        await again.close()
    finally:
        await first.close()  # already deleted through `again`: a 404 that close() absorbs
    with pytest.raises(NotFoundError) as info:
        await AsyncSandbox.connect("sbx_9", url=fake.url, api_key=KEY)
    assert info.value.code == "sandbox_not_found"


# -- error mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "expected"),
    [
        (400, InvalidRequestError),
        (401, AuthenticationError),
        (404, NotFoundError),
        (409, ConflictError),
        (422, InvalidRequestError),
        (429, RateLimitError),
        (500, ServerError),
        (503, ServerError),
        (418, APIError),
    ],
)
async def test_error_statuses_map_to_exceptions(
    fake: FakeKernelHost, status: int, expected: type[APIError]
) -> None:
    fake.fail_next(status, {"error": {"code": "some_code", "message": "human text", "n": 1}})
    with pytest.raises(APIError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    exc = info.value
    assert type(exc) is expected
    assert (exc.status, exc.code, exc.message) == (status, "some_code", "human text")
    assert exc.details["n"] == 1
    assert "human text" in str(exc) and "POST /v1/sandboxes" in str(exc)


async def test_error_without_json_body(fake: FakeKernelHost) -> None:
    fake.fail_next(502, "<html>Bad Gateway</html>")
    with pytest.raises(ServerError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    assert info.value.code == "http_502"
    assert "Bad Gateway" in info.value.message


async def test_rate_limit_carries_retry_after(fake: FakeKernelHost) -> None:
    fake.fail_next(429, {"error": {"code": "too_many", "message": "slow down"}}, {"Retry-After": "7"})
    with pytest.raises(RateLimitError) as info:
        await AsyncSandbox.create(url=fake.url, api_key=KEY)
    assert info.value.retry_after == 7.0


async def test_execute_error_status_is_mapped(fake: FakeKernelHost) -> None:
    async with AsyncSandbox(url=fake.url, api_key=KEY) as sbx:
        fake.fail_next(409, {"error": {"code": "sandbox_busy", "message": "busy"}})
        with pytest.raises(ConflictError, match="busy"):
            await sbx.run_code("1")
