"""``KernelhostProvisioner``: a jupyter_client kernel provisioner whose kernel runs in a sandbox.

A kernelspec opts in (``kernelhost kernelspec install`` writes one)::

    "metadata": {"kernel_provisioner": {"provisioner_name": "kernelhost-provisioner",
                                        "config": {"template": "python"}}}

Then nbclient, papermill, ``jupyter nbconvert --execute``, ``jupyter console`` and a local
jupyter_server start that kernel as usual, and its code runs in a kernelhost VM. How:

- ``launch_kernel`` starts a kernel on the service (``POST /api/kernels``: a new sandbox) and a
  local bridge process (``kernelhost.jupyter.bridge``) that serves the kernel's ZeroMQ sockets on
  127.0.0.1 and relays them over the kernel's WebSocket. The bridge is the "kernel process" the
  manager polls, waits for and signals.
- Interrupt (``interrupt_mode: signal``, so ``send_signal(SIGINT)``) is ``POST .../interrupt``.
- Restart: the manager's ``shutdown_request`` is answered by the bridge, which exits; the next
  ``launch_kernel`` restarts the sandbox's kernel (``POST .../restart``, fresh state, same VM) and
  starts a new bridge on the same ports with the same key, so connected clients carry on.
- Shutdown deletes the sandbox (``cleanup(restart=False)``).
- What the kernel takes from here (``workdir.py``): the environment variables the user names
  (``forward_env``, ``KERNELHOST_FORWARD_ENV``, and those the kernelspec's ``env`` sets), and the
  files the user names (``upload``, ``KERNELHOST_UPLOAD``), relative to the notebook's directory
  (the ``cwd`` jupyter_client launches with), uploaded into ``working_dir`` at the first start.
  The bridge sets the variables and enters ``working_dir`` with a silent cell on every start and
  restart, before any client's message.

Where the service is: the ``url`` config (kernelspec ``config``), else ``KERNELHOST_URL``, else
``http://127.0.0.1:8999``. The API key: the environment variable named by ``api_key_env``
(``KERNELHOST_API_KEY``); it is never written into a kernelspec. Like the SDK, this speaks HTTP
only and imports nothing of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.provisioning.provisioner_base import KernelProvisionerBase
from traitlets import Float, Integer, List, Unicode

from ..client._http import resolve_config
from .workdir import (
    FORWARD_ENV_VAR,
    UPLOAD_VAR,
    WorkdirError,
    forwarded_env,
    named,
    remote_path,
    setup_code,
    upload_plan,
)

PROVISIONER_NAME = "kernelhost-provisioner"
GONE = object()  # what a call answers when the kernel is not there (any more)


class KernelhostError(RuntimeError):
    """The service refused or could not be reached; the message names the call and the fix."""


class KernelhostProvisioner(KernelProvisionerBase):
    """Runs the kernel in a kernelhost sandbox (see the module docstring)."""

    url = Unicode(
        "", config=True, help="The kernelhost service; empty: KERNELHOST_URL, else http://127.0.0.1:8999"
    )
    template = Unicode(
        "python",
        config=True,
        help="The sandbox template (kernelspec name on the service's Kernel Gateway API)",
    )
    api_key_env = Unicode(
        "KERNELHOST_API_KEY", config=True, help="The environment variable that holds the API key"
    )
    idle_timeout_seconds = Integer(
        0,
        config=True,
        help="Seconds without activity before the service hibernates or deletes the sandbox; 0: its default",
    )
    launch_timeout = Float(120.0, config=True, help="Seconds a start or restart may take")
    request_timeout = Float(30.0, config=True, help="Seconds for interrupt and delete calls")
    forward_env = List(
        Unicode(),
        config=True,
        help="Environment variables passed to the kernel (names, or patterns like 'AWS_*'); "
        f"{FORWARD_ENV_VAR} (comma-separated) adds more at run time",
    )
    upload = List(
        Unicode(),
        config=True,
        help="Files, directories or glob patterns, relative to the notebook's directory, uploaded "
        f"into the kernel's working directory at start; {UPLOAD_VAR} (comma-separated) adds more",
    )
    working_dir = Unicode(
        "",
        config=True,
        help="The kernel's working directory in the VM, made if missing; empty: its home, "
        "/home/user (a relative path is under it)",
    )

    process: subprocess.Popen[bytes] | None = None
    remote_id: str | None = None  # the kernel id on the service (also the sandbox)
    sandbox_id: str | None = None
    _restarting = False

    # -- the service ------------------------------------------------------------------------------

    def _creds(self) -> tuple[str, str]:
        cfg = resolve_config(self.url or None, os.environ.get(self.api_key_env) or None)
        return cfg.url, cfg.api_key

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        timeout: float | None = None,
        missing_ok: bool = False,
        **extra: Any,
    ) -> Any:
        """One call to the service; a 404 is ``GONE`` with ``missing_ok`` (and for DELETE).
        ``extra``: more of aiohttp's request arguments (``data``, ``params``, ``headers``)."""
        url, key = self._creds()
        wait = aiohttp.ClientTimeout(total=timeout or self.request_timeout, connect=10.0)
        headers = {"Authorization": f"token {key}", **extra.pop("headers", {})}
        try:
            async with (
                aiohttp.ClientSession(timeout=wait) as http,
                http.request(method, url + path, json=body, headers=headers, **extra) as resp,
            ):
                if resp.status == 404 and (missing_ok or method == "DELETE"):
                    return GONE
                if resp.status >= 400:
                    raise KernelhostError(_explain(method, url + path, resp.status, await resp.text()))
                return None if resp.status == 204 else await resp.json()
        except TimeoutError as exc:  # aiohttp's has no message
            limit = wait.total
            raise KernelhostError(
                f"kernelhost at {url} did not answer {method} {path} within {limit:g}s; the "
                "service may be overloaded (see its log), or raise the kernelspec's "
                f"{'launch_timeout' if limit == self.launch_timeout else 'request_timeout'}"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise KernelhostError(
                f"cannot reach kernelhost at {url} ({method} {path}): "
                f"{str(exc) or type(exc).__name__}; start it with 'kernelhost serve', or point the "
                "kernelspec's 'url' or KERNELHOST_URL at it"
            ) from exc

    # -- lifecycle --------------------------------------------------------------------------------

    @property
    def has_process(self) -> bool:
        return self.process is not None

    async def pre_launch(self, **kwargs: Any) -> dict[str, Any]:
        kwargs = await super().pre_launch(**kwargs)
        self._creds()  # fail here, before anything starts, if no key is set
        kwargs["cmd"] = [sys.executable, "-m", "kernelhost.jupyter.bridge"]
        return kwargs

    async def launch_kernel(self, cmd: list[str], **kwargs: Any) -> KernelConnectionInfo:
        if self.process is not None and self.process.poll() is None and not self._restarting:
            # start_kernel on a manager whose kernel runs (nbclient's start_new_kernel called
            # twice): a local kernel launched again on the same connection file cannot bind its
            # ports and dies, and the clients keep the running one; here the running one is kept
            # without a second sandbox that nothing would ever shut down
            self.log.warning("kernelhost: kernel %s is running already; it is kept", self.kernel_id)
            return self.connection_info
        created = self.remote_id is None
        try:
            return await self._launch(cmd, kwargs)
        except BaseException:
            if created and self.remote_id is not None:  # a kernel nobody will ever use
                remote, self.remote_id = self.remote_id, None
                with contextlib.suppress(KernelhostError):  # the launch error is the news
                    await asyncio.shield(self._call("DELETE", f"/api/kernels/{remote}"))
            raise

    async def _launch(self, cmd: list[str], kwargs: dict[str, Any]) -> KernelConnectionInfo:
        env: dict[str, str] = dict(kwargs.get("env") or os.environ)
        spec_env = (getattr(self.kernel_spec, "env", None) or {}).keys()
        try:
            forwarded = forwarded_env(
                env, named(self.forward_env, env, FORWARD_ENV_VAR), spec_env, keep_out=(self.api_key_env,)
            )
            files: list[tuple[Path, str]] = []
            if self.remote_id is None:  # files outlive a restart; they go at the first start
                cwd = Path(kwargs.get("cwd") or os.getcwd())
                files = await in_thread(upload_plan, cwd, named(self.upload, env, UPLOAD_VAR))
        except WorkdirError as exc:  # before anything starts
            raise KernelhostError(f"kernelhost provisioner: {exc}") from None
        if self.remote_id is None:
            body: dict[str, Any] = {
                "name": self.template,
                "env": {"KERNEL_USERNAME": os.environ.get("USER", "")},
            }
            if self.idle_timeout_seconds:
                body["idle_timeout_seconds"] = self.idle_timeout_seconds
            model = await self._call("POST", "/api/kernels", body, timeout=self.launch_timeout)
            self.remote_id, self.sandbox_id = model["id"], model.get("sandbox_id")
            self.log.info("kernelhost: kernel %s runs in sandbox %s", self.kernel_id, self.sandbox_id)
            await self._upload(files)
        elif self._restarting:
            await self._call(
                "POST", f"/api/kernels/{self.remote_id}/restart", {}, timeout=self.launch_timeout
            )
        self._restarting = False
        if forwarded:
            self.log.info("kernelhost: passing %s to kernel %s", ", ".join(forwarded), self.kernel_id)
        return await self._start_bridge(cmd, kwargs, setup_code(forwarded, self.working_dir))

    async def _upload(self, files: list[tuple[Path, str]]) -> None:
        """Each planned file to its path under the working directory, streamed."""
        for local, name in files:
            size = (await in_thread(local.stat)).st_size
            await self._call(
                "PUT",
                f"/v1/sandboxes/{self.sandbox_id}/files",
                timeout=self.launch_timeout,
                params={"path": remote_path(self.working_dir, name)},
                data=_chunks(local),
                headers={"Content-Length": str(size), "Content-Type": "application/octet-stream"},
            )
        if files:
            self.log.info(
                "kernelhost: uploaded %d files into %s of sandbox %s",
                len(files),
                self.working_dir or "/home/user",
                self.sandbox_id,
            )

    async def _start_bridge(self, cmd: list[str], kwargs: dict[str, Any], setup: str) -> KernelConnectionInfo:
        """The local bridge process, its ports and the connection info."""
        info: dict[str, Any] = dict(self.connection_info)
        key = info.get("key") or _session_key(self.parent) or uuid.uuid4().hex.encode()
        ports = {
            k: int(info.get(k) or 0)
            for k in ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
        }
        url, api_key = self._creds()
        scheme = info.get("signature_scheme") or "hmac-sha256"
        # A plain Popen, as LocalProvisioner does: jupyter_client may call each method on a
        # different event loop (run_sync), so the bridge cannot be one loop's asyncio child.
        self.process = subprocess.Popen(  # noqa: ASYNC220
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, env=kwargs.get("env")
        )
        config = {
            "url": url,
            "api_key": api_key,
            "kernel_id": self.remote_id,
            "ip": "127.0.0.1",
            "ports": ports,
            "signature_scheme": scheme,
            "key": key.decode() if isinstance(key, bytes) else key,
            "setup": setup,
            "setup_timeout": self.launch_timeout,
            "parent_pid": os.getpid(),
        }
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps(config).encode())
        self.process.stdin.close()
        try:
            async with asyncio.timeout(self.launch_timeout):
                line = await in_thread(self.process.stdout.readline)
        except TimeoutError:
            self.process.kill()
            raise KernelhostError(
                f"the local bridge to kernel {self.remote_id} did not start within {self.launch_timeout:g}s"
            ) from None
        answer: dict[str, Any] = json.loads(line) if line.strip() else {"error": "it exited without a word"}
        if "ports" not in answer:
            await in_thread(self.process.wait, 10)
            self._forget()
            raise KernelhostError(
                f"the local bridge to kernel {self.remote_id} failed: {answer.get('error')}"
            )
        ports = {k: int(answer["ports"][k]) for k in ports}
        self.connection_info = KernelConnectionInfo(
            transport="tcp",
            ip="127.0.0.1",
            **ports,  # type: ignore[typeddict-item]
            key=key if isinstance(key, bytes) else key.encode(),
            signature_scheme=scheme,
            kernel_name=str(getattr(self.parent, "kernel_name", "") or ""),
        )
        return self.connection_info

    async def poll(self) -> int | None:
        return None if self.process is None else self.process.poll()

    async def wait(self) -> int | None:
        if self.process is None:
            return None
        while self.process.poll() is None:  # noqa: ASYNC110 (not a child of this loop)
            await asyncio.sleep(0.1)
        code = self.process.returncode
        self._forget()
        return code

    async def send_signal(self, signum: int) -> None:
        """SIGINT interrupts the kernel in the VM; 0 asks nothing; others go to the bridge."""
        if signum == signal.SIGINT:
            if self.remote_id is not None:  # (every shutdown interrupts first: a gone kernel
                # has nothing to interrupt, and its shutdown must still go through)
                if (
                    await self._call("POST", f"/api/kernels/{self.remote_id}/interrupt", {}, missing_ok=True)
                    is GONE
                ):
                    self.log.warning(
                        "kernelhost: kernel %s has no sandbox any more (%s)", self.kernel_id, self.sandbox_id
                    )
        elif signum != 0 and self.process is not None and self.process.poll() is None:
            self.process.send_signal(signum)

    async def kill(self, restart: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()

    async def terminate(self, restart: bool = False) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()

    async def shutdown_requested(self, restart: bool = False) -> None:
        self._restarting = restart

    async def cleanup(self, restart: bool = False) -> None:
        if self.process is not None:
            if self.process.poll() is None:
                self.process.kill()
            await in_thread(self.process.wait, 10)
            self._forget()
        if restart:
            self._restarting = True  # a kill (now=True) restart sends no shutdown_request
            return
        if self.remote_id is not None:
            remote, self.remote_id = self.remote_id, None
            await self._call("DELETE", f"/api/kernels/{remote}")
            self.log.info("kernelhost: deleted sandbox %s of kernel %s", self.sandbox_id, self.kernel_id)

    def _forget(self) -> None:
        """Drop the ended bridge process and its pipe."""
        if self.process is not None and self.process.stdout is not None:
            self.process.stdout.close()
        self.process = None

    def get_shutdown_wait_time(self, recommended: float = 5.0) -> float:
        return recommended

    async def get_provisioner_info(self) -> dict[str, Any]:
        info = await super().get_provisioner_info()
        conn = dict(info.get("connection_info") or {})
        if isinstance(conn.get("key"), bytes):
            conn["key"] = conn["key"].decode()
        info["connection_info"] = conn
        info["kernelhost"] = {"remote_id": self.remote_id, "sandbox_id": self.sandbox_id}
        return info

    async def load_provisioner_info(self, provisioner_info: dict[str, Any]) -> None:
        await super().load_provisioner_info(provisioner_info)
        ours = provisioner_info.get("kernelhost") or {}
        self.remote_id, self.sandbox_id = ours.get("remote_id"), ours.get("sandbox_id")


T = TypeVar("T")


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a thread of its own, awaited. Not ``asyncio.to_thread``: jupyter_client
    keeps one event loop per thread across calls (run_sync), and a process forked from one that
    used it (``concurrent.futures.ProcessPoolExecutor``, multiprocessing's default on Linux)
    inherits its default executor without the threads, so work sent there never runs."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name="kernelhost-provisioner", daemon=True).start()
    return await future


async def _chunks(path: Path, size: int = 1 << 20) -> AsyncIterator[bytes]:
    """``path``'s bytes, read off the event loop."""
    f = await in_thread(lambda: path.open("rb"))
    try:
        while chunk := await in_thread(f.read, size):
            yield chunk
    finally:
        f.close()


def _session_key(km: Any) -> bytes | None:
    key = getattr(getattr(km, "session", None), "key", None)
    return key if isinstance(key, bytes) and key else None


def _explain(method: str, url: str, status: int, text: str) -> str:
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text[:300]
    hint = {
        401: "; set KERNELHOST_API_KEY to an API key of that service",
        404: "; the kernel's sandbox is gone (deleted, or expired after its idle timeout)",
        503: "; the service could not start a VM: see its log",
    }.get(status, "")
    return f"kernelhost answered {method} {url} with {status}: {message}{hint}"
