"""The kernel provisioner and ``kernelhost kernelspec install``: papermill, ``jupyter nbconvert
--execute``, ``jupyter console`` and jupyter_client itself run their code in kernelhost VMs."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import nbformat
import pytest
from nbformat import v4

from ..harness import Service
from .conftest import JUPYTER_KERNEL

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]

# nbformat's functions are unannotated (untyped calls to strict mypy): typed here as used
new_notebook: Callable[..., nbformat.NotebookNode] = v4.new_notebook
new_code_cell: Callable[..., nbformat.NotebookNode] = v4.new_code_cell
write_notebook: Callable[..., None] = nbformat.write
read_notebook: Callable[..., nbformat.NotebookNode] = nbformat.read

BIN = Path(sys.executable).parent


def _notebook(path: Path) -> None:
    params = new_code_cell("x = 1")
    params.metadata["tags"] = ["parameters"]
    nb = new_notebook(
        cells=[
            params,
            new_code_cell("y = x * 10\nprint('y =', y)"),
            new_code_cell("import os, socket\nprint(os.getcwd(), socket.gethostname())"),
            new_code_cell("y + 1"),
        ]
    )
    nb.metadata["kernelspec"] = {"name": JUPYTER_KERNEL, "display_name": "kernelhost", "language": "python"}
    write_notebook(nb, path)


def _stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o["text"] for o in cell.outputs if o["output_type"] == "stream" and o["name"] == "stdout")


def _check_ran_in_vm(cell: nbformat.NotebookNode) -> None:
    cwd, hostname = _stdout(cell).split()
    assert cwd == "/home/user"  # the guest kernel's directory
    assert hostname != socket.gethostname()


def test_papermill_runs_a_notebook_in_a_vm(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    src, out = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    _notebook(src)
    run = subprocess.run(
        [
            str(BIN / "papermill"),
            str(src),
            str(out),
            "-k",
            JUPYTER_KERNEL,
            "-p",
            "x",
            "4",
            "--execution-timeout",
            "120",
        ],
        env=jupyter_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cells = read_notebook(out, as_version=4).cells
    injected = next(c for c in cells if "injected-parameters" in c.metadata.get("tags", []))
    assert "x = 4" in injected.source
    # a variable set by one cell is used by the next ones, in the same kernel
    assert _stdout(cells[2]) == "y = 40\n"
    _check_ran_in_vm(cells[3])
    assert cells[4].outputs[0]["data"]["text/plain"] == "41"


def test_nbconvert_execute(jupyter_env: dict[str, str], tmp_path: Path) -> None:
    src = tmp_path / "nb.ipynb"
    _notebook(src)
    run = subprocess.run(
        [
            str(BIN / "jupyter"),
            "nbconvert",
            "--to",
            "notebook",
            "--execute",
            str(src),
            "--output",
            "executed",
            f"--ExecutePreprocessor.kernel_name={JUPYTER_KERNEL}",
            "--ExecutePreprocessor.timeout=120",
        ],
        env=jupyter_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cells = read_notebook(tmp_path / "executed.ipynb", as_version=4).cells
    assert _stdout(cells[1]) == "y = 10\n"
    _check_ran_in_vm(cells[2])
    assert cells[3].outputs[0]["data"]["text/plain"] == "11"


def test_jupyter_console(jupyter_env: dict[str, str], jupyter_service: Service) -> None:
    run = subprocess.run(
        [
            str(BIN / "jupyter"),
            "console",
            "--kernel",
            JUPYTER_KERNEL,
            "--simple-prompt",
            "--ZMQTerminalInteractiveShell.kernel_timeout=120",
        ],
        input="z = 6 * 7\nprint('console says', z)\n",
        env=jupyter_env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "console says 42" in run.stdout, run.stdout[-3000:]
    # the console shuts its kernel down with a shutdown_request alone: the sandbox goes too
    sandbox = re.search(r"runs in sandbox (sbx_\w+)", run.stderr)
    assert sandbox is not None, run.stderr[-3000:]
    url = f"{jupyter_service.url}/v1/sandboxes/{sandbox.group(1)}"
    deadline = time.monotonic() + 30
    while _status(url, jupyter_service.api_key) != 404:
        assert time.monotonic() < deadline, f"{sandbox.group(1)} outlived its console: {run.stderr[-3000:]}"
        time.sleep(0.2)


def _status(url: str, key: str) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_interrupt_and_restart_through_the_provisioner(
    jupyter_env: dict[str, str], jupyter_service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_client.manager import AsyncKernelManager

    from kernelhost.jupyter.provisioner import KernelhostProvisioner

    for name in (
        "KERNELHOST_URL",
        "KERNELHOST_API_KEY",
        "JUPYTER_PATH",
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_DATA_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTER_PLATFORM_DIRS",
    ):
        monkeypatch.setenv(name, jupyter_env[name])
    km = AsyncKernelManager(kernel_name=JUPYTER_KERNEL)
    await km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        await kc.wait_for_ready(timeout=120)
        provisioner = km.provisioner
        assert provisioner is not None and type(provisioner).__name__ == "KernelhostProvisioner"
        provisioner = cast(KernelhostProvisioner, provisioner)  # as just checked
        remote = provisioner.remote_id
        ports = {k: km.get_connection_info()[k] for k in ("shell_port", "iopub_port")}

        reply = await kc.execute_interactive("v = 'kept'", timeout=60)
        assert reply["content"]["status"] == "ok"

        # interrupt: KeyboardInterrupt in the VM's kernel, its variables kept. (Not stopping on
        # the error: ipykernel aborts the requests that reach it while it ends an erring cell,
        # and the next cell goes as soon as this one's reply is in.)
        msg_id = kc.execute("import time\ntime.sleep(600)", stop_on_error=False)
        await _wait_busy(kc, msg_id)
        await km.interrupt_kernel()
        reply = await _reply(kc, msg_id, 60)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"
        seen: list[str] = []
        reply = await kc.execute_interactive(
            "print(v)",
            timeout=60,
            output_hook=lambda m: seen.append(
                m["content"]["text"] if m["content"].get("name") == "stdout" else ""
            ),
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        assert "".join(seen) == "kept\n"

        # restart: same sandbox, same local ports (connected clients carry on), fresh kernel
        await km.restart_kernel()
        await kc.wait_for_ready(timeout=120)
        assert provisioner.remote_id == remote
        assert {k: km.get_connection_info()[k] for k in ("shell_port", "iopub_port")} == ports
        reply = await kc.execute_interactive("v", timeout=60)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "NameError"
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()
    # shutdown deleted the kernel's sandbox
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"token {jupyter_service.api_key}"}) as http,
        http.get(f"{jupyter_service.url}/api/kernels/{remote}") as r,
    ):
        assert r.status == 404, await r.text()


async def _wait_busy(kc: object, msg_id: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while loop.time() < deadline:
        msg = await kc.get_iopub_msg(timeout=max(0.1, deadline - loop.time()))  # type: ignore[attr-defined]
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "execute_input":
            return
    raise AssertionError(f"the kernel did not start running {msg_id} within 60s")


async def _reply(kc: object, msg_id: str, timeout: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        msg = await kc.get_shell_msg(timeout=max(0.1, deadline - loop.time()))  # type: ignore[attr-defined]
        if msg["parent_header"].get("msg_id") == msg_id:
            return msg  # type: ignore[no-any-return]
    raise AssertionError(f"no reply to {msg_id} within {timeout}s: {json.dumps(msg_id)}")


async def test_a_wrong_key_fails_the_start_naming_the_fix(
    jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from jupyter_client.manager import AsyncKernelManager

    from kernelhost.jupyter.provisioner import KernelhostError

    for name in (
        "KERNELHOST_URL",
        "JUPYTER_PATH",
        "JUPYTER_CONFIG_DIR",
        "JUPYTER_DATA_DIR",
        "JUPYTER_RUNTIME_DIR",
        "JUPYTER_PLATFORM_DIRS",
    ):
        monkeypatch.setenv(name, jupyter_env[name])
    monkeypatch.setenv("KERNELHOST_API_KEY", "not-a-key")
    km = AsyncKernelManager(kernel_name=JUPYTER_KERNEL)
    with pytest.raises(KernelhostError, match=r"401.*KERNELHOST_API_KEY"):
        await km.start_kernel()


# -- issue 39, item 7: the environment and the working directory ---------------------------------


def _workdir_notebook(path: Path) -> None:
    nb = new_notebook(
        cells=[
            new_code_cell("import os\nprint(os.environ.get('KH_DEMO_A'), os.environ.get('KH_DEMO_B'))"),
            new_code_cell("print(os.environ.get('DATA_URL'), os.environ.get('KH_OTHER'))"),
            new_code_cell("print(open('data.csv').read().strip(), sorted(os.listdir('lookup')))"),
            new_code_cell("os.getcwd()"),
        ]
    )
    nb.metadata["kernelspec"] = {"name": JUPYTER_KERNEL, "display_name": "kernelhost", "language": "python"}
    write_notebook(nb, path)


def test_papermill_forwards_named_variables_and_uploads_named_files(
    jupyter_env: dict[str, str], tmp_path: Path
) -> None:
    """papermill run in the notebook's directory: ``KERNELHOST_FORWARD_ENV`` names what the
    kernel sees of the environment, ``KERNELHOST_UPLOAD`` what it finds in its directory."""
    project = tmp_path / "project"
    (project / "lookup").mkdir(parents=True)
    (project / "data.csv").write_text("a,b\n1,2\n")
    (project / "lookup" / "k.json").write_text("{}")
    (project / "not-uploaded.txt").write_text("x")
    _workdir_notebook(project / "in.ipynb")
    env = {
        **jupyter_env,
        "KERNELHOST_FORWARD_ENV": "KH_DEMO_*, DATA_URL",
        "KERNELHOST_UPLOAD": "data.csv,lookup",
        "KH_DEMO_A": "alpha",
        "KH_DEMO_B": "beta with spaces and 'quotes'",
        "DATA_URL": "s3://bucket/key",
        "KH_OTHER": "not forwarded",
    }
    run = subprocess.run(
        [str(BIN / "papermill"), "in.ipynb", "out.ipynb", "-k", JUPYTER_KERNEL, "--execution-timeout", "120"],
        env=env,
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    cells = read_notebook(project / "out.ipynb", as_version=4).cells
    assert _stdout(cells[0]) == "alpha beta with spaces and 'quotes'\n"
    assert _stdout(cells[1]) == "s3://bucket/key None\n"
    assert _stdout(cells[2]) == "a,b\n1,2 ['k.json']\n"
    assert cells[3].outputs[0]["data"]["text/plain"] == "'/home/user'"
    # the setup cell is silent: the notebook's cells are counted from 1, as on a local kernel
    assert [c.execution_count for c in cells] == [1, 2, 3, 4]


async def test_kernelspec_config_survives_a_restart(
    jupyter_env: dict[str, str], jupyter_service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernelspec whose provisioner config names the variables, the files and the VM's
    working directory (and whose own ``env`` is forwarded), started by jupyter_client in the
    notebook's directory; a restart (a fresh kernel process) keeps all three."""
    from jupyter_client.manager import AsyncKernelManager

    from kernelhost.jupyter.kernelspec import kernel_json

    spec = kernel_json("python", "workdir test")
    spec["env"] = {"KH_FROM_SPEC": "spec-value"}
    spec["metadata"]["kernel_provisioner"]["config"].update(
        forward_env=["KH_SPEC_VAR"], upload=["notes.txt"], working_dir="/home/user/project"
    )
    kernels = tmp_path / "jupyter" / "kernels" / "kh-workdir"
    kernels.mkdir(parents=True)
    (kernels / "kernel.json").write_text(json.dumps(spec))
    project = tmp_path / "nb"
    project.mkdir()
    (project / "notes.txt").write_text("uploaded notes")
    for name in ("KERNELHOST_URL", "KERNELHOST_API_KEY", "JUPYTER_CONFIG_DIR", "JUPYTER_DATA_DIR"):
        monkeypatch.setenv(name, jupyter_env[name])
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", jupyter_env["JUPYTER_RUNTIME_DIR"])
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("KH_SPEC_VAR", "from the launcher")
    km = AsyncKernelManager(kernel_name="kh-workdir")
    await km.start_kernel(cwd=str(project))
    kc = km.client()
    kc.start_channels()
    probe = (
        "import os\n"
        "print(os.getcwd(), os.environ['KH_SPEC_VAR'], os.environ['KH_FROM_SPEC'], open('notes.txt').read())"
    )
    want = "/home/user/project from the launcher spec-value uploaded notes\n"
    try:
        await kc.wait_for_ready(timeout=120)
        for _ in ("started", "restarted"):
            seen: list[str] = []
            reply = await kc.execute_interactive(probe, timeout=60, output_hook=_stdout_into(seen))
            assert reply["content"]["status"] == "ok", reply["content"]
            assert "".join(seen) == want and reply["content"]["execution_count"] == 1
            await km.restart_kernel()
            await kc.wait_for_ready(timeout=120)
    finally:
        kc.stop_channels()
        await km.shutdown_kernel()


def _stdout_into(seen: list[str]) -> Callable[[dict[str, Any]], None]:
    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream" and msg["content"].get("name") == "stdout":
            seen.append(msg["content"]["text"])

    return hook
