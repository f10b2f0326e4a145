"""Issue 35, finding 14: the deploy example's placeholders (and obviously weak values) are no
secrets. Settings refuse them with an error naming the setting and the fix, and
``kernelhost serve`` does not start with them."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kernelhost.config import ConfigError, Settings

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "deploy" / "kubernetes" / "base" / "secret.example.yaml"


def _example() -> dict[str, str]:
    """The example Secret's values, as the DaemonSet maps them to settings."""
    data = yaml.safe_load(EXAMPLE.read_text())["stringData"]
    return {
        "KERNELHOST_STORE_URL": data["store-url"],
        "KERNELHOST_CLUSTER_SECRET": data["cluster-secret"],
        "KERNELHOST_API_KEYS": data["api-keys"],
    }


def _real() -> dict[str, str]:
    return {
        "KERNELHOST_STORE_URL": "postgresql://kernelhost:s3cr3t-pw@db.internal:5432/kernelhost",
        "KERNELHOST_CLUSTER_SECRET": secrets.token_hex(32),
        "KERNELHOST_API_KEYS": f"{secrets.token_hex(24)},{secrets.token_hex(24)}",
    }


def _load(tmp_path: Path, **env: str) -> Settings:
    return Settings.load({"KERNELHOST_STATE_DIR": str(tmp_path), "KERNELHOST_NODE_ID": "n1", **env})


def test_real_values_pass(tmp_path: Path) -> None:
    settings = _load(tmp_path, **_real())
    assert settings.cluster and len(settings.api_keys) == 2


@pytest.mark.parametrize(
    "setting", ["KERNELHOST_API_KEYS", "KERNELHOST_CLUSTER_SECRET", "KERNELHOST_STORE_URL"]
)
def test_each_placeholder_of_the_example_secret_is_refused(tmp_path: Path, setting: str) -> None:
    env = {**_real(), setting: _example()[setting]}  # only this one is the example's
    with pytest.raises(ConfigError) as err:
        _load(tmp_path, **env)
    message = str(err.value)
    assert setting.removeprefix("KERNELHOST_").lower() in message and setting in message
    assert "placeholder" in message
    assert _example()[setting] not in message  # a secret setting's value is never printed


@pytest.mark.parametrize(
    ("setting", "value", "why"),
    [
        ("KERNELHOST_CLUSTER_SECRET", "0123456789abcdef", "16 characters long; use at least 32"),
        ("KERNELHOST_CLUSTER_SECRET", "ab" * 32, "2 distinct characters"),
        ("KERNELHOST_API_KEYS", "short-key", "9 characters long; use at least 16"),
        ("KERNELHOST_API_KEYS", "1" * 40, "1 distinct characters"),
        ("KERNELHOST_OPERATOR_KEYS", "changeme" + secrets.token_hex(8), "placeholder"),
        ("KERNELHOST_API_KEYS", "your_key_" + secrets.token_hex(8), "placeholder"),
    ],
)
def test_weak_values_are_refused(tmp_path: Path, setting: str, value: str, why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        _load(tmp_path, **{**_real(), setting: value})
    assert setting in str(err.value) and "openssl rand -hex 32" in str(err.value)


def test_the_cluster_secret_may_not_be_an_api_key(tmp_path: Path) -> None:
    env = _real()
    env["KERNELHOST_CLUSTER_SECRET"] = env["KERNELHOST_API_KEYS"].split(",")[0] + "x" * 8
    env["KERNELHOST_API_KEYS"] += "," + env["KERNELHOST_CLUSTER_SECRET"]
    with pytest.raises(ConfigError, match=r"cluster_secret .* is also an API key"):
        _load(tmp_path, **env)


def test_serve_refuses_to_start_with_the_example_values(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KERNELHOST_")}
    env.update(_example(), KERNELHOST_STATE_DIR=str(tmp_path), KERNELHOST_PORT="1")
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "kernelhost"), "serve"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "configuration error" in proc.stderr and "KERNELHOST_API_KEYS" in proc.stderr
    assert "placeholder" in proc.stderr
    assert not (tmp_path / "kernelhost.db").exists()
