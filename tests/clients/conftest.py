"""Fixtures for the clients tier: real client libraries driving a real ``kernelhost serve``.

Each tool's fixtures live in their own marked section below; add a section, do not edit another's.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import start_new_kernel

from ..harness import REPO, Service, running_service
from .jupyter_support import JupyterLab

RESULTS = REPO / "results"

# == Jupyter: tests/clients/test_jupyter_*.py =======================================================
# Fixture graph (session scoped)::
#
#     jupyter_service ──> jupyter_env ──> jupyter_lab      a `jupyter lab` with --gateway-url
#                                   └──> kernelspec env    (JUPYTER_PATH holds the installed
#                                                           kernelhost-python kernelspec)
#
# One service for every Jupyter test (its own prefix and state); at teardown no domain and no VM
# directory of its prefix may be left, and its log is kept as results/jupyter-service.log.

JUPYTER_KERNEL = "kernelhost-python"


@pytest.fixture(scope="session")
def jupyter_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with running_service(
        tmp_path_factory.mktemp("jupyter-state"), "jupyter", KERNELHOST_REAPER_INTERVAL="1"
    ) as svc:
        yield svc


@pytest.fixture(scope="session")
def jupyter_env(jupyter_service: Service, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for Jupyter tools: the service's URL and key, private Jupyter directories,
    and the kernelspec installed by ``kernelhost kernelspec install`` (the real command)."""
    home = tmp_path_factory.mktemp("jupyter-home")
    prefix = home / "prefix"
    env = {
        **os.environ,
        "KERNELHOST_URL": jupyter_service.url,
        "KERNELHOST_API_KEY": jupyter_service.api_key,
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
        "JUPYTER_CONFIG_DIR": str(home / "config"),
        "JUPYTER_DATA_DIR": str(home / "data"),
        "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "IPYTHONDIR": str(home / "ipython"),
        "HOME": str(home),
    }
    subprocess.run(
        [sys.executable, "-m", "kernelhost.cli", "kernelspec", "install", "--prefix", str(prefix)],
        env=env,
        check=True,
        timeout=60,
        capture_output=True,
    )
    assert (prefix / "share" / "jupyter" / "kernels" / JUPYTER_KERNEL / "kernel.json").is_file()
    return env


@pytest.fixture(scope="session")
def jupyter_lab(
    jupyter_env: dict[str, str], jupyter_service: Service, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[JupyterLab]:
    """``jupyter lab`` (jupyter_server + JupyterLab) whose kernels live on the service."""
    root = tmp_path_factory.mktemp("notebooks")
    port = _free_port()
    token = "lab-token-" + os.urandom(6).hex()
    log_path = root.parent / "jupyter-lab.log"
    env = {**jupyter_env, "KERNEL_LAUNCH_TIMEOUT": "120"}
    # no "get notified about Jupyter news?" toast over the screenshot (and no fetch of it)
    settings = (
        Path(env["JUPYTER_CONFIG_DIR"])
        / "lab"
        / "user-settings"
        / "@jupyterlab"
        / "apputils-extension"
        / "notification.jupyterlab-settings"
    )
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text('{"fetchNews": "false", "checkForUpdates": false}\n')
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--allow-root",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.terminals_enabled=False",
        f"--gateway-url={jupyter_service.url}",
        f"--GatewayClient.auth_token={jupyter_service.api_key}",
        "--GatewayClient.request_timeout=130",
        "--GatewayClient.connect_timeout=30",
        "--LabApp.news_url=None",
        "--LabApp.check_for_updates_class=jupyterlab.handlers.announcements.NeverCheckForUpdate",
    ]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(f"{url}/api/status", {"Authorization": f"token {token}"}, proc, log_path, 120)
        yield JupyterLab(url, token, root, log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        RESULTS.mkdir(exist_ok=True)
        shutil.copy(log_path, RESULTS / "jupyter-lab.log")


def _wait_http(
    url: str, headers: dict[str, str], proc: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the process exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout}s: {log.read_text()[-3000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# == end of the Jupyter section =====================================================================


# == Templates in Jupyter: tests/clients/test_jupyter_templates.py =================================
# Fixture graph (session scoped)::
#
#     jupyter_service ──> jupyter_template      a key's own template, built through the SDK and
#                                               deleted at the end


@pytest.fixture(scope="session")
def jupyter_template(jupyter_service: Service) -> Iterator[str]:
    from kernelhost import Sandbox, Template

    url, key = jupyter_service.url, jupyter_service.api_key
    spec = {"name": "notebook-kit", "pip": ["tomli-w==1.2.0"], "env": {"KIT_RUN": os.urandom(4).hex()}}
    info = Template.build(spec, url=url, api_key=key)
    assert info.state == "ready", info
    try:
        yield info.name
    finally:
        for sbx in Sandbox.list(url=url, api_key=key):  # a kernel a failed test left running
            if sbx.template == info.name:
                Sandbox.connect(sbx.id, url=url, api_key=key).close()
        Template.delete(info.name, url=url, api_key=key)


# -- a kernel through the provisioner, for the protocol-level tests ------------------------------


@pytest.fixture
def vm_kernel(jupyter_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[BlockingKernelClient]:
    """A ``kernelhost-python`` kernel started by jupyter_client (the provisioner), its client."""
    for key, value in jupyter_env.items():
        monkeypatch.setenv(key, value)
    km, kc = start_new_kernel(kernel_name=JUPYTER_KERNEL, startup_timeout=120)
    try:
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# == Other projects' suites: tests/clients/test_*_suite.py, agents/test_langchain_suite.py =========
# Their counts (suite_support.SUMMARY) in pytest's terminal summary, so a passing run shows them
# too (pytest keeps a passing test's output to itself), and in results/suites.txt.


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from .suite_support import SUMMARY

    if SUMMARY:
        terminalreporter.write_sep("=", "other projects' suites")
        for line in SUMMARY:
            terminalreporter.write_line(line)
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "suites.txt").write_text("\n".join(SUMMARY) + "\n")
