"""Fixtures for the cluster tier: one real PostgreSQL (``tests/pg.py``) and three real
``kernelhost serve`` nodes on this machine (own ports, state directories, domain prefixes and
run directories; one libvirt), sharing one hibernation directory. The tests drive node A only.

Every node has the same two client keys and an operator key; a key holds at most 5 sandboxes
(the quota test needs a limit), and no node keeps a warm pool (three pools would not fit the
machine's two cores).

Node B advertises a relay (``relay.py``) in front of it: every call another node forwards to B
crosses it and is kept, as an attacker on the network between the nodes would see it.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import shutil
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ..harness import REPO, Service, cluster_node
from ..pg import PostgresServer, running_postgres
from .relay import Relay

LEASE = 6.0
LIMIT = 5


@dataclass
class Cluster:
    a: Service
    b: Service
    c: Service
    operator_key: str
    pg: PostgresServer
    hibernate_dir: Path
    store_url: str
    secret: str
    relay_b: Relay  # between the other nodes and node B

    @property
    def nodes(self) -> dict[str, Service]:
        return {"node-a": self.a, "node-b": self.b, "node-c": self.c}


def _delete_all(svc: Service) -> None:
    for key in (svc.api_key, svc.other_key):
        headers = {"Authorization": f"Bearer {key}"}
        req = urllib.request.Request(svc.url + "/v1/sandboxes", headers=headers)
        with contextlib.suppress(OSError), urllib.request.urlopen(req, timeout=30) as r:
            for sbx in json.load(r)["sandboxes"]:
                if sbx.get("node") == svc.env["KERNELHOST_NODE_ID"]:
                    gone = urllib.request.Request(
                        f"{svc.url}/v1/sandboxes/{sbx['id']}", headers=headers, method="DELETE"
                    )
                    with contextlib.suppress(OSError), urllib.request.urlopen(gone, timeout=60):
                        pass


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with running_postgres() as pg:
        yield pg


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory, postgres: PostgresServer) -> Iterator[Cluster]:
    url = postgres.new_database("cluster_tier")
    shared = tmp_path_factory.mktemp("hibernated-shared")
    key, other = "test-key-" + secrets.token_hex(12), "other-key-" + secrets.token_hex(12)
    operator = "operator-key-" + secrets.token_hex(12)
    secret = secrets.token_hex(16)
    services: list[Service] = []
    run_dirs: list[Path] = []
    relay: Relay | None = None
    try:
        for name in ("node-a", "node-b", "node-c"):
            state = tmp_path_factory.mktemp(f"state-{name}")
            # QEMU (libvirt's user) must reach it: not under pytest's private temp directory
            run_dir = Path(f"/run/kernelhost/cluster-{name}-{secrets.token_hex(3)}")
            run_dir.mkdir(mode=0o755, parents=True)
            run_dirs.append(run_dir)
            svc = cluster_node(
                state,
                run_dir,
                name,
                url,
                secret,
                LEASE,
                shared,
                KERNELHOST_API_KEYS=f"{key},{other}",
                KERNELHOST_OPERATOR_KEYS=operator,
                KERNELHOST_MAX_SANDBOXES_PER_KEY=str(LIMIT),
                KERNELHOST_REAPER_INTERVAL="1",
            )
            svc.api_key, svc.other_key = key, other
            if name == "node-b":
                relay = Relay(int(svc.env["KERNELHOST_PORT"]))
                svc.env["KERNELHOST_ADVERTISE_URL"] = relay.url
            svc.start(timeout=180)
            services.append(svc)
        a, b, c = services
        assert relay is not None
        yield Cluster(a, b, c, operator, postgres, shared, url, secret, relay)
    finally:
        for svc in services:  # what the tests kept: each live node deletes its own
            if svc.proc is not None and svc.proc.poll() is None:
                _delete_all(svc)
        leaks = []
        results = REPO / "results"
        results.mkdir(exist_ok=True)
        for n, svc in enumerate(services):
            leaked, leaked_dirs = svc.cleanup()
            leaks += leaked + leaked_dirs
            shutil.copy(svc.log_path, results / f"cluster-node-{'abc'[n]}-service.log")
        for run_dir in run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)
        if relay is not None:
            relay.close()
        assert not leaks, f"the cluster tier left VMs or VM directories behind: {leaks}"
