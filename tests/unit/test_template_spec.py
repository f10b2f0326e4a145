"""Template specs: every field checked, with an error that names it and the fix."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest

from kernelhost.sandboxes.templates import SpecError, parse_spec, spec_from_wire

pytestmark = pytest.mark.unit

BUILTINS = ("python", "python-datasci", "r")

FULL = """
name = "ml"
base = "python"
description = "scikit-learn and a data file"
apt = ["libgomp1"]
pip = ["scikit-learn==1.5.2", "polars>=1"]
preload = ["sklearn.linear_model"]
setup = ["mkdir -p /opt/data"]
memory_mib = 1024
vcpus = 2
writable_mib = 256
network = "allowlist"
allow = ["example.org"]

[env]
MODE = "fast"
"""


def test_a_full_toml_spec_round_trips_through_its_wire_form() -> None:
    spec = parse_spec(tomllib.loads(FULL), builtins=BUILTINS)
    assert spec.name == "ml" and spec.pip == ("scikit-learn==1.5.2", "polars>=1")
    assert dict(spec.env) == {"MODE": "fast"} and spec.memory_mib == 1024
    wire = spec.wire()
    assert wire["env"] == {"MODE": "fast"} and wire["apt"] == ["libgomp1"]
    again = spec_from_wire({**wire, "files_sha256": "ab" * 32})
    assert again.files_sha256 == "ab" * 32 and again.with_files("") == spec


def test_defaults() -> None:
    spec = parse_spec({"name": "tiny"}, builtins=BUILTINS)
    assert (spec.base, spec.kernel, spec.apt, spec.memory_mib, spec.files_dest) == (
        "python", "python", (), None, "/home/user",
    )  # fmt: skip
    assert parse_spec({"name": "new", "base": "debian:trixie"}).suite == "trixie"


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({}, "name", "required"),
        ({"name": "ML"}, "name", "lower-case"),
        ({"name": "python"}, "name", "built-in"),
        ({"name": "x", "colour": "red"}, "colour", "unknown field"),
        ({"name": "x", "base": "ubuntu"}, "base", "debian:trixie"),
        ({"name": "x", "base": "debian:Trixie!"}, "base", "no distribution release"),
        ({"name": "x", "pip": "numpy"}, "pip", "write ['numpy']"),
        ({"name": "x", "pip": ["numpy==="]}, "pip", "not a requirement"),
        ({"name": "x", "pip": ["pkg @ https://example.org/p.whl"]}, "pip", "from a URL"),
        ({"name": "x", "apt": ["Bad Name"]}, "apt", "Debian package name"),
        ({"name": "x", "apt": [3]}, "apt[0]", "must be a string"),
        ({"name": "x", "env": {"1X": "y"}}, "env", "variable name"),
        ({"name": "x", "env": {"X": 1}}, "env.X", "string"),
        ({"name": "x", "preload": ["os; import sys"]}, "preload", "module name"),
        ({"name": "x", "kernel": "bash", "preload": ["x"]}, "preload", "python and r"),
        ({"name": "x", "kernel": "r", "preload": ["ggplot2"]}, None, None),
        ({"name": "x", "kernel": "no such/kernel"}, "kernel", "installed kernelspec"),
        ({"name": "x", "memory_mib": 64}, "memory_mib", "from 256"),
        ({"name": "x", "vcpus": True}, "vcpus", "integer"),
        ({"name": "x", "memory_mib": 512, "writable_mib": 600}, "writable_mib", "does not fit"),
        ({"name": "x", "network": "open"}, "network", "allowlist"),
        ({"name": "x", "files_dest": "relative"}, "files_dest", "absolute"),
        ({"name": "x", "setup": [""]}, "setup", "non-empty"),
    ],
)
def test_each_bad_field_is_named_with_its_fix(
    data: dict[str, Any], field: str | None, words: str | None
) -> None:
    if field is None:
        parse_spec(data, builtins=BUILTINS)
        return
    with pytest.raises(SpecError) as err:
        parse_spec(data, builtins=BUILTINS)
    assert err.value.field == field
    assert words is not None and words in str(err.value)


def test_not_a_table() -> None:
    with pytest.raises(SpecError, match="table"):
        parse_spec(["name"])  # type: ignore[arg-type]
