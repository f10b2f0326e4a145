"""A template spec: what a user's own environment is made of, checked field by field.

The same fields come from a TOML file (the CLI), JSON over REST and the SDK. ``parse_spec``
turns any of them into a ``TemplateSpec`` or raises ``SpecError`` naming the field, the value
and the fix. ``TemplateSpec.wire()`` is the canonical JSON form: what is stored, what the build
script reads and what the content key hashes.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement

from ...config import TEMPLATE_NAME_RE

__all__ = [
    "BUILTIN_KERNELS",
    "DISTRIBUTION_PREFIX",
    "SpecError",
    "TemplateSpec",
    "parse_spec",
    "spec_from_wire",
]

#: ``base = "debian:<suite>"``: a distribution release (the host's apt sources, another suite)
DISTRIBUTION_PREFIX = "debian:"
#: kernel names with a meaning of their own; anything else is a kernelspec installed in the image
BUILTIN_KERNELS = ("python", "r", "bash")
NETWORK_MODES = ("none", "allowlist", "outbound")

NAME = TEMPLATE_NAME_RE
SUITE = re.compile(r"^[a-z]{3,20}$")
APT_PACKAGE = re.compile(r"^[a-z0-9][a-z0-9+.-]{0,99}(=[A-Za-z0-9.+~:-]{1,60})?$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
KERNELSPEC = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
R_PACKAGE = re.compile(r"^[A-Za-z][A-Za-z0-9.]*$")
#: an absolute guest path without "." or ".." components, empty components or control characters
#: (it is resolved inside the build VM's root, never on the host; refused here so that a spec
#: says what it means)
GUEST_PATH = re.compile(r"\A(?:/|(?:/(?!\.\.?(?:/|\Z))[^/\x00-\x1f\x7f]+)+/?)\Z")

MAX_ITEMS = 200  # packages, setup commands, preloads, env entries
MAX_TEXT = 16384  # one setup command, one env value, the description


class SpecError(ValueError):
    """A spec field that cannot be built: ``field`` names it, the message says the fix."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"template spec: {field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    base: str = "python"
    description: str = ""
    apt: tuple[str, ...] = ()
    pip: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()
    preload: tuple[str, ...] = ()
    kernel: str = "python"
    memory_mib: int | None = None
    vcpus: int | None = None
    writable_mib: int | None = None
    network: str | None = None
    allow: tuple[str, ...] = ()
    #: where the uploaded files archive is unpacked in the guest ("" when there is none)
    files_dest: str = "/home/user"
    #: sha256 of the uploaded files archive, "" without one (set by the service, not the user)
    files_sha256: str = ""

    @property
    def from_distribution(self) -> bool:
        return self.base.startswith(DISTRIBUTION_PREFIX)

    @property
    def suite(self) -> str | None:
        return self.base.removeprefix(DISTRIBUTION_PREFIX) if self.from_distribution else None

    def wire(self) -> dict[str, Any]:
        """The canonical JSON form (lists for tuples, env as a map, no empty extras)."""
        data = asdict(self)
        data["env"] = dict(self.env)
        for name in ("apt", "pip", "setup", "preload", "allow"):
            data[name] = list(data[name])
        return data

    def with_files(self, sha256: str) -> TemplateSpec:
        return dataclasses.replace(self, files_sha256=sha256)


def parse_spec(data: Mapping[str, Any], *, builtins: tuple[str, ...] = ()) -> TemplateSpec:
    """A ``TemplateSpec`` from TOML or JSON data; ``builtins``: the template names a ``base``
    may name (besides ``debian:<suite>``) and a new template may not take."""
    if not isinstance(data, Mapping):
        raise SpecError("spec", f"must be a table (a JSON object), got {type(data).__name__}")
    known = set(TemplateSpec.__dataclass_fields__) - {"files_sha256"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(unknown[0], f"unknown field; the fields are {', '.join(sorted(known))}")
    name = _text(
        data, "name", required=True, pattern=NAME, hint="lower-case letters, digits and '-', at most 40"
    )
    if name in builtins:
        raise SpecError("name", f"{name!r} is a built-in template; choose another name")
    base = _base(data.get("base", "python"), builtins)
    kernel = _kernel(data.get("kernel", "python"))
    spec = TemplateSpec(
        name=name,
        base=base,
        description=_text(data, "description", default=""),
        apt=tuple(_each(data, "apt", _apt_package)),
        pip=tuple(_each(data, "pip", _pip_requirement)),
        env=tuple(sorted(_env(data.get("env", {})).items())),
        setup=tuple(_each(data, "setup", _setup_command)),
        preload=tuple(_each(data, "preload", lambda v: _preload(v, kernel))),
        kernel=kernel,
        memory_mib=_int(data, "memory_mib", 256, 65536),
        vcpus=_int(data, "vcpus", 1, 64),
        writable_mib=_int(data, "writable_mib", 16, 1 << 20),
        network=_network(data.get("network")),
        allow=tuple(
            _each(data, "allow", lambda v: _text({"allow": v}, "allow", pattern=re.compile(r"^\S{1,260}$")))
        ),
        files_dest=_text(
            data,
            "files_dest",
            default="/home/user",
            pattern=GUEST_PATH,
            hint="an absolute guest path without '.' or '..' components, e.g. /home/user/data",
        ),
    )
    if spec.memory_mib and spec.writable_mib and spec.writable_mib >= spec.memory_mib:
        raise SpecError(
            "writable_mib",
            f"{spec.writable_mib} MiB of writable space does not fit in {spec.memory_mib} MiB of "
            "memory (it lives in the guest's RAM); lower it or raise memory_mib",
        )
    return spec


# -- fields -------------------------------------------------------------------------------------


def _text(
    data: Mapping[str, Any],
    name: str,
    *,
    required: bool = False,
    default: str | None = None,
    pattern: re.Pattern[str] | None = None,
    hint: str = "",
) -> str:
    value = data.get(name, default)
    if value is None:
        if required:
            raise SpecError(name, "is required")
        return ""
    if not isinstance(value, str):
        raise SpecError(name, f"must be a string, got {type(value).__name__} {value!r:.60}")
    if len(value) > MAX_TEXT:
        raise SpecError(name, f"is {len(value)} characters long; at most {MAX_TEXT}")
    if pattern is not None and not pattern.match(value):
        raise SpecError(name, f"{value!r:.80} is not valid" + (f" ({hint})" if hint else ""))
    return value


def _each(data: Mapping[str, Any], name: str, check: Any) -> list[str]:
    values = data.get(name, [])
    if isinstance(values, str):
        raise SpecError(
            name, f"must be a list of strings, got the string {values!r:.60}; write [{values!r:.60}]"
        )
    if not isinstance(values, list | tuple):
        raise SpecError(name, f"must be a list, got {type(values).__name__}")
    if len(values) > MAX_ITEMS:
        raise SpecError(name, f"has {len(values)} entries; at most {MAX_ITEMS}")
    out = []
    for i, value in enumerate(values):
        if not isinstance(value, str):
            raise SpecError(f"{name}[{i}]", f"must be a string, got {type(value).__name__} {value!r:.60}")
        out.append(check(value))
    return out


def _base(value: Any, builtins: tuple[str, ...]) -> str:
    if not isinstance(value, str):
        raise SpecError("base", f"must be a string, got {type(value).__name__}")
    if value.startswith(DISTRIBUTION_PREFIX):
        suite = value.removeprefix(DISTRIBUTION_PREFIX)
        if not SUITE.match(suite):
            raise SpecError("base", f"{value!r} names no distribution release; write e.g. 'debian:trixie'")
        return value
    if builtins and value not in builtins:
        raise SpecError(
            "base",
            f"{value!r} is neither a built-in template ({', '.join(builtins)}) nor a distribution "
            "release ('debian:<suite>', e.g. 'debian:trixie')",
        )
    return value


def _kernel(value: Any) -> str:
    if not isinstance(value, str) or not KERNELSPEC.match(value):
        raise SpecError(
            "kernel",
            f"{value!r:.60} is not a kernel; use 'python', 'r', 'bash' or an installed kernelspec's name",
        )
    return value


def _apt_package(value: str) -> str:
    if not APT_PACKAGE.match(value):
        raise SpecError("apt", f"{value!r:.80} is not a Debian package name (optionally '=version')")
    return value


def _pip_requirement(value: str) -> str:
    try:
        req = Requirement(value)
    except InvalidRequirement as exc:
        raise SpecError(
            "pip", f"{value!r:.80} is not a requirement ({exc}); write e.g. 'polars==1.2.0'"
        ) from None
    if req.url:
        raise SpecError("pip", f"{value!r:.80} installs from a URL; name a package from the index")
    return str(req)


def _setup_command(value: str) -> str:
    if not value.strip() or len(value) > MAX_TEXT:
        raise SpecError("setup", f"each command must be non-empty and at most {MAX_TEXT} characters")
    return value


def _preload(value: str, kernel: str) -> str:
    pattern = R_PACKAGE if kernel == "r" else MODULE
    if kernel not in ("python", "r"):
        raise SpecError("preload", f"preloading is for the python and r kernels, not {kernel!r}")
    if not pattern.match(value):
        what = "an R package name" if kernel == "r" else "a Python module name (dotted)"
        raise SpecError("preload", f"{value!r:.80} is not {what}")
    return value


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SpecError("env", f'must be a table of NAME = "value", got {type(value).__name__}')
    if len(value) > MAX_ITEMS:
        raise SpecError("env", f"has {len(value)} entries; at most {MAX_ITEMS}")
    out = {}
    for key, val in value.items():
        if not isinstance(key, str) or not ENV_NAME.match(key):
            raise SpecError("env", f"{key!r:.60} is not a variable name (letters, digits, '_')")
        if not isinstance(val, str) or "\0" in val or len(val) > MAX_TEXT:
            raise SpecError(f"env.{key}", f"must be a string without NUL of at most {MAX_TEXT} characters")
        out[key] = val
    return out


def _int(data: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpecError(name, f"must be an integer from {low} to {high}, got {value!r:.40}")
    return value


def _network(value: Any) -> str | None:
    if value is None:
        return None
    if value not in NETWORK_MODES:
        raise SpecError("network", f"{value!r:.40} is not a mode; use one of {', '.join(NETWORK_MODES)}")
    return str(value)


def spec_from_wire(data: Mapping[str, Any]) -> TemplateSpec:
    """A stored spec (``wire()``), files digest included."""
    fields = dict(data)
    files_sha256 = str(fields.pop("files_sha256", "") or "")
    return parse_spec(fields).with_files(files_sha256)
