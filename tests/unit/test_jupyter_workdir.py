"""What a provisioned kernel takes from the machine that starts it (issue 39, item 7), without a
VM: the variables named (and patterns), the files named and where each goes, and the setup cell
run in a Python like the kernel's. (Through a real VM: tests/clients/test_jupyter_provisioner.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelhost.jupyter.workdir import (
    WorkdirError,
    forwarded_env,
    named,
    remote_path,
    setup_code,
    upload_plan,
)

pytestmark = pytest.mark.unit


def test_named_takes_the_config_then_the_variable() -> None:
    env = {"KERNELHOST_FORWARD_ENV": " B, C ,,"}
    assert named(["A", " "], env, "KERNELHOST_FORWARD_ENV") == ["A", "B", "C"]
    assert named([], {}, "KERNELHOST_FORWARD_ENV") == []


def test_forwarded_env_names_patterns_and_the_kernelspecs_own() -> None:
    env = {
        "DATA_URL": "s3://b/x",
        "AWS_REGION": "eu",
        "AWS_PROFILE": "p",
        "HOME": "/root",
        "SPEC_VAR": "1",
        "KERNELHOST_API_KEY": "kh_secret",
    }
    got = forwarded_env(env, ["DATA_URL", "AWS_*", "UNSET"], spec_env=["SPEC_VAR"])
    assert got == {"AWS_PROFILE": "p", "AWS_REGION": "eu", "DATA_URL": "s3://b/x", "SPEC_VAR": "1"}
    # a pattern never carries the API key into the VM; naming it exactly does
    keep_out = ("KERNELHOST_API_KEY",)
    assert "KERNELHOST_API_KEY" not in forwarded_env(env, ["KERNELHOST_*"], keep_out=keep_out)
    assert forwarded_env(env, ["KERNELHOST_API_KEY"], keep_out=keep_out) == {
        "KERNELHOST_API_KEY": "kh_secret"
    }
    with pytest.raises(WorkdirError, match="not an environment variable name"):
        forwarded_env(env, ["A=B"])


def test_upload_plan_keeps_paths_relative_to_the_notebook(tmp_path: Path) -> None:
    nb = tmp_path / "project"
    (nb / "data" / "raw").mkdir(parents=True)
    (nb / "data.csv").write_text("a,b\n")
    (nb / "data" / "raw" / "x.json").write_text("{}")
    (nb / "notes.md").write_text("n")
    (nb / "c1.txt").write_text("1")
    (nb / "c2.txt").write_text("2")
    outside = tmp_path / "shared" / "lookup.csv"
    outside.parent.mkdir()
    outside.write_text("k,v\n")
    plan = upload_plan(nb, ["data.csv", "data", "c*.txt", str(outside), "data.csv"])
    assert [(str(local.relative_to(tmp_path)), remote) for local, remote in plan] == [
        ("project/c1.txt", "c1.txt"),
        ("project/c2.txt", "c2.txt"),
        ("project/data.csv", "data.csv"),
        ("project/data/raw/x.json", "data/raw/x.json"),
        ("shared/lookup.csv", "lookup.csv"),  # outside the notebook's directory: its own name
    ]
    assert [remote for _, remote in upload_plan(nb, ["../shared"])] == ["shared/lookup.csv"]
    with pytest.raises(WorkdirError, match=r"'missing.csv': no such file"):
        upload_plan(nb, ["missing.csv"])
    with pytest.raises(WorkdirError, match=r"nothing in .* matches"):
        upload_plan(nb, ["*.parquet"])
    assert remote_path("", "data/x.json") == "data/x.json"
    assert remote_path("/home/user/nb/", "data/x.json") == "/home/user/nb/data/x.json"


def test_the_setup_cell_sets_the_variables_and_enters_the_directory(tmp_path: Path) -> None:
    assert setup_code({}, "") == ""
    tricky = {"QUOTES": "it's \"quoted\"\nand\\'escaped'", "EMPTY": "", "UNICODE": "ünï"}
    code = setup_code(tricky, str(tmp_path / "work" / "here"))
    # run as the kernel runs a cell: in one namespace, which it must leave as it found it
    probe = (
        "import json, os, sys\n"
        "ns = {}\n"
        "exec(sys.stdin.read(), ns)\n"
        "print(json.dumps({'cwd': os.getcwd(), 'env': {k: os.environ[k] for k in "
        f"{sorted(tricky)!r}}}, 'names': sorted(k for k in ns if k != '__builtins__')}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], input=code, capture_output=True, text=True, check=True, cwd=tmp_path
    )
    seen = json.loads(out.stdout)
    assert seen == {"cwd": str(tmp_path / "work" / "here"), "env": tricky, "names": []}
    # a relative working directory is under the kernel's starting directory
    code = setup_code({}, "nb")
    probe = "import os, sys; exec(sys.stdin.read(), {}); print(os.getcwd())"
    out = subprocess.run(
        [sys.executable, "-c", probe], input=code, capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert out.stdout.strip() == os.path.join(tmp_path, "nb")
