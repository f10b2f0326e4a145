"""A real ``kernelhost serve`` process for tests and benchmarks, on its own prefix and state.

Every started service is in ``LIVE`` until it is cleaned up, so a failed test can save the
evidence of each (``Service.save_evidence``: its log, and the domain XML and serial console of
every VM of its prefix) before the fixtures tear them down (``tests/conftest.py``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypervisor import Hypervisor

REPO = Path(__file__).resolve().parents[1]
#: services started and not yet cleaned up, in start order
LIVE: list[Service] = []


@dataclass
class Service:
    url: str
    api_key: str
    other_key: str
    prefix: str
    state_dir: Path
    run_dir: Path
    log_path: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    starts: list[float] = field(default_factory=list)
    #: what the command runs under (``["ip", "netns", "exec", NAME]`` for a test network)
    launcher: list[str] = field(default_factory=list)
    #: the module run as ``kernelhost`` (tests/cluster/newer_node.py: the next release's schema)
    module: str = "kernelhost.cli"
    #: why the last stop had to kill the service (it did not end within its deadline)
    stop_error: str = ""

    def start(self, timeout: float = 60.0) -> None:
        with self.log_path.open("ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [*self.launcher, sys.executable, "-m", self.module, "serve"],
                env=self.env,
                stdout=log,
                stderr=log,
                cwd=REPO,
            )
        if self not in LIVE:
            LIVE.append(self)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kernelhost serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        self.starts.append(time.time())
                        return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"service did not answer within {timeout}s: {self.log_path.read_text()[-3000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> None:
        """Signal the service and wait for it to end; one that does not end within ``timeout``
        is killed, and ``cleanup`` then fails naming it (a stop that hangs is a defect: it leaves
        the VMs it did not get to). Its log says what the stop waited for (api/server.py)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            self.stop_error = f"the service did not stop within {timeout:.0f}s of signal {sig} and was killed"

    def kill(self) -> None:
        """The service killed outright (SIGKILL: a host that dies) and every VM of its prefix
        destroyed with it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        hv = self.hypervisor()
        try:
            hv.reconcile(set())
        finally:
            hv.close()

    def wait_pool(self, template: str, timeout: float = 900.0) -> None:
        """Until the service's pool holds a ready clone of ``template`` (its snapshot is built):
        an SDK whose first create has a request timeout of its own does not then wait out a
        cold snapshot build (at once when an earlier tier built it: snapshots are shared)."""
        deadline = time.monotonic() + timeout
        auth = {"Authorization": f"Bearer {self.api_key}"}
        request = urllib.request.Request(f"{self.url}/healthz", headers=auth)
        while True:
            with urllib.request.urlopen(request, timeout=30) as answer:
                if json.load(answer).get("pool", {}).get(template, 0) >= 1:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"no ready {template} sandbox in the pool within {timeout} s")
            time.sleep(0.5)

    def log_events(self, event: str) -> list[dict[str, Any]]:
        """The service log's lines of ``event`` (structlog's JSON), in order."""
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [json.loads(line) for line in lines if f'"{event}"' in line]

    def save_evidence(self, dest: Path) -> None:
        """Copy the service log, and each of its VMs' domain XML and serial console, to
        ``dest``; what cannot be read is noted, never raised (a test has failed already)."""
        dest.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            shutil.copy(self.log_path, dest / "service.log")
        hv = self.hypervisor()
        try:
            for info in hv.domains():
                (dest / f"{info.name}.xml").write_text(hv.domain_xml(info.name))
                console = hv.vm_dir(info.name) / "console.log"
                if console.is_file():
                    shutil.copy(console, dest / f"{info.name}.console.log")
        except Exception as exc:  # evidence is best effort: keep what was saved, say what not
            (dest / "evidence-error.txt").write_text(f"{type(exc).__name__}: {exc}\n")
        finally:
            hv.close()

    def hypervisor(self) -> Hypervisor:
        return Hypervisor(self.env.get("KERNELHOST_LIBVIRT_URI", "qemu:///system"), self.prefix, self.run_dir)

    @classmethod
    def make(cls, state_dir: Path, **env_overrides: str) -> Service:
        """A service on a free port with two API keys and a unique domain prefix (not started)."""
        prefix = f"kht{secrets.token_hex(3)}-"
        run_dir = Path(env_overrides.pop("KERNELHOST_RUN_DIR", "/run/kernelhost/vms"))
        port = _free_port()
        key, other = "test-key-" + secrets.token_hex(12), "other-key-" + secrets.token_hex(12)
        env = {
            **os.environ,
            "KERNELHOST_PORT": str(port),
            "KERNELHOST_STATE_DIR": str(state_dir),
            "KERNELHOST_RUN_DIR": str(run_dir),
            "KERNELHOST_DOMAIN_PREFIX": prefix,
            "KERNELHOST_API_KEYS": f"{key},{other}",
            "KERNELHOST_LOG_FORMAT": "json",
            # the tests of limits expect a refusal at once; the queue's own tests set a wait
            "KERNELHOST_CREATE_QUEUE_SECONDS": "0",
            **env_overrides,
        }
        host = env.get("KERNELHOST_HOST", "127.0.0.1")
        return cls(
            f"http://{host}:{port}", key, other, prefix, state_dir, run_dir, state_dir / "service.log", env
        )

    def cleanup(self) -> tuple[list[str], list[str]]:
        """Stop, destroy whatever of our prefix is left; return (leaked domains, leaked dirs)."""
        with contextlib.suppress(ValueError):
            LIVE.remove(self)
        self.stop()
        hv = self.hypervisor()
        try:
            leaked = [d.name for d in hv.domains()]
            leaked_dirs = [p.name for p in self.run_dir.glob(self.prefix + "*")]
            ram_dir = Path(self.env.get("KERNELHOST_RAM_DIR", "/dev/shm/kernelhost"))
            forks = ram_dir / "forks"
            leaked_dirs += [str(p) for p in forks.glob(self.prefix.rstrip("-"))]
            shutil.rmtree(forks / self.prefix.rstrip("-"), ignore_errors=True)
            self._drop_templates(ram_dir)
            hv.reconcile(set())
        finally:
            hv.close()
        leaked_dirs += self._drop_partitions()
        if self.stop_error:
            tail = self.log_path.read_text(errors="replace")[-6000:]
            raise AssertionError(f"{self.stop_error}; left {leaked + leaked_dirs}; its log ends:\n{tail}")
        return leaked, leaked_dirs

    def _drop_partitions(self) -> list[str]:
        """This service's CPU partitions left after its stop (hypervisor/cgroups.py: a key's
        goes with its last VM, the service's own at stop): named as leaks, then removed."""
        found = sorted(Path("/sys/fs/cgroup").glob(f"*/machine/{self.prefix}*.partition"))
        found += sorted(Path("/sys/fs/cgroup/machine").glob(f"{self.prefix}*.partition"))
        for path in found:
            for sub in sorted(path.rglob("*"), key=lambda p: -len(p.parts)):
                if sub.is_dir():
                    with contextlib.suppress(OSError):
                        sub.rmdir()
            with contextlib.suppress(OSError):
                path.rmdir()
        return [str(p) for p in found]

    def _drop_templates(self, ram_dir: Path) -> None:
        """The images (in the shared image dir) and snapshots (RAM) of the templates this
        service built: its keys' own (``name@<key id>``, unique to a test service's random keys)
        and its operator's (named by the spec files of its template dir). They outlive a real
        service by design; a test service's state is temporary, so no later one starts from them."""
        from kernelhost.api.auth import key_id

        image_dir = Path(self.env.get("KERNELHOST_IMAGE_DIR", "/var/cache/kernelhost/images"))
        names = [f"*@{key_id(k)}" for k in (self.api_key, self.other_key)]
        template_dir = self.env.get("KERNELHOST_TEMPLATE_DIR")
        if template_dir:
            names += [glob.escape(spec.stem) for spec in Path(template_dir).glob("*.toml")]
        for name in names:
            found = [*image_dir.glob(name), *image_dir.glob(f"{name}-*"), *image_dir.glob(f".build-{name}-*")]
            for path in found:  # template layers only: a built-in image is never touched
                if path.name.startswith(".build-"):
                    shutil.rmtree(path, ignore_errors=True)
                elif path.is_symlink() and (not path.exists() or (path / "layer.erofs").exists()):
                    path.unlink(missing_ok=True)
                elif not path.is_symlink() and (path / "layer.erofs").exists():
                    shutil.rmtree(path, ignore_errors=True)
            for snap in (ram_dir / "templates").glob(f"{name}-*"):
                if re.fullmatch(r".*-\d+m\d+c[a-z]+-[0-9a-f]+", snap.name):
                    shutil.rmtree(snap, ignore_errors=True)


def cluster_node(
    state_dir: Path,
    run_dir: Path,
    name: str,
    store_url: str,
    secret: str,
    lease: float,
    shared: Path,
    **env: str,
) -> Service:
    """A node of a test cluster (docs/cluster.md), not started: its store, id, secret, lease and
    the shared hibernation directory set, and its advertised URL its own."""
    svc = Service.make(
        state_dir,
        KERNELHOST_RUN_DIR=str(run_dir),
        KERNELHOST_STORE_URL=store_url,
        KERNELHOST_NODE_ID=name,
        KERNELHOST_CLUSTER_SECRET=secret,
        KERNELHOST_NODE_LEASE_SECONDS=str(lease),
        KERNELHOST_HIBERNATE_DIR=str(shared),
        KERNELHOST_POOL_SIZE="0",
        **env,
    )
    svc.env["KERNELHOST_ADVERTISE_URL"] = svc.url
    return svc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_service(
    state_dir: Path,
    name: str,
    start_timeout: float = 120.0,
    launcher: list[str] | None = None,
    **env: str,
) -> Iterator[Service]:
    """A started service for one test tier; on exit it is stopped, its log kept as
    ``results/<name>-service.log``, and no domain or VM directory of its prefix may be left.
    ``launcher``: what the service runs under (a network namespace)."""
    svc = Service.make(state_dir, **env)
    svc.launcher = list(launcher or [])
    svc.start(timeout=start_timeout)
    try:
        yield svc
    finally:
        leaked, leaked_dirs = svc.cleanup()
        results = REPO / "results"
        results.mkdir(exist_ok=True)
        shutil.copy(svc.log_path, results / f"{name}-service.log")
        assert not leaked, f"domains left behind by the {name} tests: {leaked}"
        assert not leaked_dirs, f"VM directories left behind by the {name} tests: {leaked_dirs}"
