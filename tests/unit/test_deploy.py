"""The deployment files in deploy/, checked offline: the Kubernetes manifests against the API's
schemas (kubernetes_validate), the kustomizations rendered here, the Nomad job parsed as HCL,
and every environment variable they set against the service's settings. No cluster, no
container engine: the image (deploy/Dockerfile) is not built."""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import hcl2
import kubernetes_validate
import pytest
import yaml

from kernelhost.config import Settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
OVERLAY = DEPLOY / "kubernetes" / "overlays" / "cloudnative-pg"
NOMAD_JOB = DEPLOY / "nomad" / "kernelhost.nomad.hcl"
K8S_VERSION = kubernetes_validate.latest_version()  # the newest schemas the package bundles

# cluster settings (docs/cluster.md): they may not be in Settings yet
CLUSTER_SETTINGS = {
    "KERNELHOST_STORE_URL",
    "KERNELHOST_NODE_ID",
    "KERNELHOST_ADVERTISE_URL",
    "KERNELHOST_CLUSTER_SECRET",
    "KERNELHOST_NODE_LEASE_SECONDS",
    "KERNELHOST_HIBERNATE_DIR",
}
HELPER_ENV = {"POD_IP"}  # not a setting: only composed into KERNELHOST_ADVERTISE_URL
NODE_ENV = CLUSTER_SETTINGS | {
    "KERNELHOST_API_KEYS",
    "KERNELHOST_HOST",
    "KERNELHOST_PORT",
    "KERNELHOST_STATE_DIR",
    "KERNELHOST_IMAGE_DIR",
    "KERNELHOST_RUN_DIR",
}
HOST_PATHS = {"/var/cache/kernelhost/images", "/var/lib/kernelhost", "/run/kernelhost", "/dev/kvm"}

Doc = dict[str, Any]


def load_docs(path: Path) -> list[Doc]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization(directory: Path) -> Doc:
    doc: Doc = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return doc


def merge(base: Any, patch: Any) -> Any:
    """A strategic merge patch, as far as deploy/'s patches need it: maps merge key by key, lists
    of named maps (containers, env, volumes) merge by name, anything else is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        return {**base, **{k: merge(base[k], v) if k in base else v for k, v in patch.items()}}
    named = isinstance(base, list) and isinstance(patch, list)
    if named and all(isinstance(item, dict) and "name" in item for item in base + patch):
        merged = list(base)
        where = {item["name"]: i for i, item in enumerate(base)}
        for item in patch:
            if item["name"] in where:
                merged[where[item["name"]]] = merge(base[where[item["name"]]], item)
            else:
                merged.append(item)
        return merged
    return patch


def render(directory: Path) -> list[Doc]:
    """``kustomize build`` for what deploy/'s kustomizations use: resources (files and
    directories), patches by file (strategic merge), namespace."""
    spec = kustomization(directory)
    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        docs += render(path) if path.is_dir() else load_docs(path)
    for entry in spec.get("patches", []):
        for patch in load_docs(directory / entry["path"]):
            targets = [i for i, doc in enumerate(docs) if ident(doc) == ident(patch)]
            assert len(targets) == 1, f"{entry['path']}: no single {patch['kind']} {name(patch)}"
            docs[targets[0]] = merge(docs[targets[0]], patch)
    for doc in docs:
        if "namespace" in spec and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = spec["namespace"]
    return docs


def name(doc: Doc) -> str:
    return str(doc["metadata"]["name"])


def ident(doc: Doc) -> tuple[str, str]:
    return str(doc["kind"]), name(doc)


def one(docs: list[Doc], kind: str) -> Doc:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}s"
    return found[0]


def container(docs: list[Doc]) -> Doc:
    ds = one(docs, "DaemonSet")
    assert name(ds) == "kernelhost-node"
    containers: list[Doc] = ds["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env(docs: list[Doc]) -> dict[str, Doc]:
    return {item["name"]: item for item in container(docs)["env"]}


def nomad_group() -> Doc:
    options = hcl2.SerializationOptions(
        with_comments=False, explicit_blocks=False, preserve_heredocs=False, strip_string_quotes=True
    )
    with NOMAD_JOB.open() as f:
        job = hcl2.load(f, serialization_options=options)["job"][0]["kernelhost"]
    assert job["type"] == "system"
    group: Doc = job["group"][0]["node"]
    return group


def nomad_task() -> Doc:
    task: Doc = nomad_group()["task"][0]["kernelhost"]
    return task


def nomad_env() -> dict[str, str]:
    """The task's env block, and the variables its templates write (env = true)."""
    task = nomad_task()
    names = dict(task["env"][0])
    for template in task["template"]:
        assert template["env"] is True
        names.update(re.findall(r"^(KERNELHOST_\w+)=(.*)$", template["data"], re.MULTILINE))
    return names


def checked_files() -> list[Path]:
    """Every Kubernetes resource file: both kustomizations' resources and the secret example."""
    files = [BASE / "secret.example.yaml"]
    for directory in (BASE, OVERLAY):
        files += [
            directory / e for e in kustomization(directory)["resources"] if not (directory / e).is_dir()
        ]
    return files


def test_every_yaml_file_is_checked() -> None:
    patches = [OVERLAY / entry["path"] for entry in kustomization(OVERLAY)["patches"]]
    known = {*checked_files(), *patches, BASE / "kustomization.yaml", OVERLAY / "kustomization.yaml"}
    assert set((DEPLOY / "kubernetes").rglob("*.yaml")) == known


@pytest.mark.parametrize("path", checked_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_manifests_match_the_kubernetes_schemas(path: Path) -> None:
    for doc in load_docs(path):
        if doc["apiVersion"] == "postgresql.cnpg.io/v1":
            # a CRD (CloudNativePG's Cluster): kubernetes_validate has no schema for it, so by hand
            assert doc["kind"] == "Cluster"
            assert doc["spec"]["instances"] == 3
            assert doc["spec"]["bootstrap"]["initdb"] == {"database": "kernelhost", "owner": "kernelhost"}
            assert name(doc) + "-app" == "kernelhost-db-app"  # the Secret CloudNativePG writes
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_kustomization_files_exist(directory: Path) -> None:
    spec = kustomization(directory)
    assert spec["namespace"] == "kernelhost"
    listed = [*spec.get("resources", []), *(entry["path"] for entry in spec.get("patches", []))]
    assert listed
    for entry in listed:
        assert (directory / entry).exists(), f"{directory}: {entry} is missing"
    assert "secret.example.yaml" not in spec["resources"]


@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_rendered_daemonset(directory: Path) -> None:
    docs = render(directory)
    ds = one(docs, "DaemonSet")
    kubernetes_validate.validate(ds, K8S_VERSION, strict=True)  # after the overlay's patch too
    pod = ds["spec"]["template"]["spec"]
    main = container(docs)
    assert pod["nodeSelector"] == {"kernelhost.dev/node": "true"}
    assert pod["terminationGracePeriodSeconds"] >= 120
    assert main["securityContext"]["privileged"] is True
    assert main["lifecycle"]["preStop"]["exec"]["command"][-3:] == ["node", "drain", "--local"]
    ports = {port["name"]: port["containerPort"] for port in main["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = main[probe]["httpGet"]
        assert get["path"] == "/healthz"
        assert ports.get(get["port"], get["port"]) == 8999

    variables = env(docs)
    assert NODE_ENV <= set(variables)
    assert variables["KERNELHOST_NODE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert variables["KERNELHOST_ADVERTISE_URL"]["value"] == "http://$(POD_IP):8999"
    assert list(variables).index("POD_IP") < list(variables).index("KERNELHOST_ADVERTISE_URL")
    assert variables["KERNELHOST_HOST"]["value"] == "0.0.0.0"
    for setting, key in [("CLUSTER_SECRET", "cluster-secret"), ("API_KEYS", "api-keys")]:
        assert variables[f"KERNELHOST_{setting}"]["valueFrom"]["secretKeyRef"] == {
            "name": "kernelhost",
            "key": key,
        }

    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["name"]: mount["mountPath"] for mount in main["volumeMounts"]}
    assert set(mounts) == set(volumes)
    host_paths = {v["hostPath"]["path"]: n for n, v in volumes.items() if "hostPath" in v}
    assert set(host_paths) == HOST_PATHS
    assert all(mounts[n] == path for path, n in host_paths.items())
    assert volumes[host_paths["/dev/kvm"]]["hostPath"]["type"] == ""  # a node without KVM still runs
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
    claim = next(n for n, v in volumes.items() if "persistentVolumeClaim" in v)
    assert volumes[claim]["persistentVolumeClaim"]["claimName"] == "kernelhost-hibernate"
    assert mounts[claim] == variables["KERNELHOST_HIBERNATE_DIR"]["value"]
    for setting in ("STATE_DIR", "IMAGE_DIR"):
        assert variables[f"KERNELHOST_{setting}"]["value"] in mounts.values()
    assert variables["KERNELHOST_RUN_DIR"]["value"].startswith(mounts[host_paths["/run/kernelhost"]] + "/")

    pvc = one(docs, "PersistentVolumeClaim")
    assert name(pvc) == "kernelhost-hibernate" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert [port["port"] for port in service["spec"]["ports"]] == [8999]
    assert all(doc["metadata"]["namespace"] == "kernelhost" for doc in docs if doc["kind"] != "Namespace")


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
@pytest.mark.parametrize("directory", [BASE, OVERLAY], ids=["base", "overlay"])
def test_render_matches_kustomize(directory: Path) -> None:
    """Where kubectl is installed, its kustomize (offline) renders what render() does."""
    built = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, check=True
    )
    assert sorted(yaml.safe_load_all(built.stdout), key=ident) == sorted(render(directory), key=ident)


def test_store_url_secrets() -> None:
    base = env(render(BASE))["KERNELHOST_STORE_URL"]["valueFrom"]["secretKeyRef"]
    assert base == {"name": "kernelhost", "key": "store-url"}
    overlay = env(render(OVERLAY))["KERNELHOST_STORE_URL"]["valueFrom"]["secretKeyRef"]
    assert overlay == {"name": "kernelhost-db-app", "key": "uri"}
    one(render(OVERLAY), "Cluster")
    secret = one(load_docs(BASE / "secret.example.yaml"), "Secret")
    assert name(secret) == "kernelhost"
    assert set(secret["stringData"]) == {"store-url", "cluster-secret", "api-keys"}


def test_nomad_job() -> None:
    task = nomad_task()
    assert task["driver"] == "raw_exec"
    assert task["config"][0]["command"] == "/opt/kernelhost/deploy/entrypoint.sh"
    assert task["kill_timeout"] == "120s"
    variables = nomad_env()
    assert NODE_ENV <= set(variables)
    assert variables["KERNELHOST_NODE_ID"] == "${node.unique.name}"
    assert variables["KERNELHOST_ADVERTISE_URL"] == "http://${attr.unique.network.ip-address}:8999"
    assert variables["KERNELHOST_STORE_URL"] == "{{ .store_url }}"
    assert 'nomadVar "nomad/jobs/kernelhost"' in task["template"][0]["data"]
    check = task["service"][0]["check"][0]
    assert (check["type"], check["path"]) == ("http", "/healthz")
    assert nomad_group()["network"][0]["port"][0]["http"]["static"] == 8999


def test_every_variable_is_a_setting() -> None:
    settings = {f"KERNELHOST_{field.name.upper()}" for field in dataclasses.fields(Settings)}
    used = set(nomad_env())
    for directory in (BASE, OVERLAY):
        for doc in render(directory):
            if doc["kind"] == "DaemonSet":
                used |= {item["name"] for item in doc["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert used - HELPER_ENV - settings - CLUSTER_SETTINGS == set()


def test_image_and_entrypoint() -> None:
    script = (REPO / "scripts" / "install-deps.sh").read_text()
    packages = re.search(r"APT_PACKAGES=\((.*?)\n\)", script, re.DOTALL)
    assert packages is not None
    wanted = shlex.split(packages[1], comments=True)
    dockerfile = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    installed = re.search(r"apt-get install -y --no-install-recommends (.*?) &&", dockerfile)
    assert installed is not None
    # only the tests need these: a browser (JupyterLab), a PostgreSQL server (the cluster tier),
    # strace (what the host runs during a template build)
    assert set(installed[1].split()) == set(wanted) - {"chromium", "postgresql", "strace"}
    assert 'ENTRYPOINT ["tini", "--", "/opt/kernelhost/deploy/entrypoint.sh"]' in dockerfile
    entrypoint = (DEPLOY / "entrypoint.sh").read_text().splitlines()
    assert entrypoint.index("scripts/start-libvirt.sh") < entrypoint.index(
        'exec .venv/bin/kernelhost serve "$@"'
    )
