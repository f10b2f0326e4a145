"""Service settings: read once at start-up from the environment and an optional TOML file.

Precedence: ``KERNELHOST_*`` environment variables, then the config file (``KERNELHOST_CONFIG``,
else ``/etc/kernelhost/config.toml`` if it exists), then the defaults below. docs/configuration.md
lists every setting.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .secret_rules import MIN_CLUSTER_SECRET_CHARS, check_secrets

DEFAULT_CONFIG_FILE = Path("/etc/kernelhost/config.toml")
#: a template's name (a spec's, sandboxes/templates/spec.py; an alias of e2b_templates)
TEMPLATE_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,39}$")
#: a DNS name of at least two labels, lower case, no trailing dot (docs/ports.md)
DOMAIN_RE = re.compile(
    r"(?=.{1,200}$)([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)+[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?"
)


class ConfigError(ValueError):
    """A setting has a value that cannot be used."""


@dataclass(frozen=True)
class Timeouts:
    """Deadlines, in seconds, of the service's waits on guests: every such wait has one.

    The first four are settings (``boot_timeout``, ``agent_timeout``, ``restart_timeout``,
    ``interrupt_grace``); the rest are fixed, named here instead of written where they are used.
    """

    boot: float  # a cold boot to a ready kernel
    agent: float  # the agent's answer to a short request (ping, interrupt, a signal)
    restart: float  # a kernel restart, before the VM is replaced instead
    interrupt_grace: float  # from a timeout's interrupt to the next rung of the ladder
    reattach: float = 15.0  # a running VM's agent, reconnected at service start
    attach: float = 30.0  # a cloned, woken or forked VM's agent, to answer hello
    hygiene: float = 30.0  # clock, entropy and reseed after a clone, wake or fork
    net_config: float = 30.0  # the guest setting up its network mode
    file_op: float = 60.0  # one file operation in the guest
    snapshot_warmup: float = 600.0  # imports and warm-up cells before a template is frozen
    cleanup: float = 30.0  # cleanups (VM destroys) still running when the service stops


@dataclass(frozen=True)
class Limits:
    """What one call may carry or produce (docs/limits.md); the host enforces each."""

    max_code_bytes: int
    max_output_bytes: int  # stdout + stderr kept per execution
    max_result_bytes: int  # one rich result, all its MIME types together
    max_file_bytes: int  # one file read or written through the files API
    max_frame_bytes: int  # one frame on a sandbox's channel


def _default_state_dir() -> Path:
    if os.geteuid() == 0:
        return Path("/var/lib/kernelhost")
    return Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "kernelhost"


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8999
    state_dir: Path = field(default_factory=_default_state_dir)
    run_dir: Path = Path("/run/kernelhost/vms")
    image_dir: Path = Path("/var/cache/kernelhost/images")
    libvirt_uri: str = "qemu:///system"
    domain_prefix: str = "kh-"
    accel: str = "auto"
    vm_memory_mib: int = 512
    vm_vcpus: int = 1
    vm_cpu_quota_percent: int = 0  # CPU time per vCPU, percent of one host CPU; 0: no cap
    # each API key's VMs share one CPU weight (a cgroup partition; docs/limits.md), as cgroup
    # v2's cpu.weight (1-10000, 100 the default); 0: no partitions, a VM's weight is its own
    cpu_weight_per_key: int = 100
    boot_timeout: float = 120.0
    max_concurrent_boots: int = 2
    default_idle_timeout: int = 600
    max_idle_timeout: int = 7 * 24 * 3600
    reaper_interval: float = 10.0
    interrupt_grace: float = 5.0
    ram_dir: Path = Path("/dev/shm/kernelhost")  # tmpfs: template and fork RAM files
    snapshots: str = "on"  # on | off (off: every sandbox cold-boots)
    pool_size: int = 2  # ready clones kept per template
    idle_action: str = "hibernate"  # hibernate | delete
    hibernate_retention_seconds: int = 7 * 24 * 3600
    max_fork: int = 32
    # docs/templates.md: builds of users' templates, and the operator's spec files
    template_dir: Path = Path("/etc/kernelhost/templates")  # *.toml built at start, for every key
    template_build_concurrency: int = 1  # template builds running at once (the rest queue)
    template_build_timeout: float = 1800.0  # seconds one build may take before it is stopped
    template_build_memory_mib: int = 2048  # a build VM's memory (its key's memory limit counts it)
    template_layer_max_mib: int = 8192  # the largest layer a build VM may produce
    max_template_builds_per_key: int = 2  # builds one key may have queued or running at once
    max_templates_per_key: int = 20  # templates one key may hold (their layers, snapshots, logs)
    template_files_max_members: int = (
        100_000  # members of a template's files archive (checked in its build VM)
    )
    max_sandboxes_per_key: int = 100  # live and hibernated sandboxes one API key may hold
    max_memory_mib_per_key: int = 32768  # sum of running sandboxes' VM memory per API key
    # a create, fork or wake over a key's limit waits this long for room, in the key's queue of
    # at most create_queue_length calls, before its 429 (docs/limits.md); 0: refused at once
    create_queue_seconds: float = 30.0
    create_queue_length: int = 32
    max_hibernated_mib_per_key: int = 65536  # disk one API key's hibernated sandboxes may take
    # docs/checkpoints.md: compressed checkpoint files one key's sandboxes may keep on disk, and
    # the checkpoints (taken by hand) one sandbox may keep
    max_checkpoint_bytes_per_key: int = 8 * 1024**3
    max_checkpoints_per_sandbox: int = 32
    live_checkpoints: str = "off"  # on: QEMU's background snapshot (needs userfaultfd) | off
    max_metadata_bytes: int = 16384  # one sandbox's metadata, as JSON
    max_requests_per_key: int = 64  # requests one API key has open at once (streams included)
    max_connections: int = 1024  # client connections the service holds at once
    header_timeout: float = 30.0  # seconds to send a request's head; also the keep-alive idle time
    body_timeout: float = 30.0  # seconds an /e2b request may take to send its body (an upload: per chunk)
    # background processes (E2B's commands, directory watchers) one sandbox, one key may run
    max_processes_per_sandbox: int = 32
    max_processes_per_key: int = 128
    max_list_entries: int = 10000  # entries of one recursive listing (E2B's ListDir) before it stops
    metrics_require_key: bool = False  # /healthz and /metrics behind an API key
    # seconds between samples of each running sandbox's CPU, memory and disk (GET
    # /metrics/sandboxes, a sandbox's metrics); 0: none are taken
    sandbox_metrics_interval: float = 5.0
    # docs/ports.md: a request for {port}-{sandbox id}.{domain} goes to that port in the sandbox
    domain: str = ""  # the wildcard DNS name in front of the service; empty: no port routing
    ports_public: bool = False  # true: a sandbox's ports answer without its traffic token
    # docs/e2b.md: E2B's template names (what its SDKs create by default) and ours they start
    e2b_templates: tuple[str, ...] = (
        "base=python",
        "code-interpreter=python-datasci",
        "code-interpreter-v1=python-datasci",
    )
    tls_cert_file: str = ""  # serve HTTPS with this certificate chain (PEM) and tls_key_file
    tls_key_file: str = ""
    max_frame_bytes: int = 64 * 1024 * 1024
    max_code_bytes: int = 4 * 1024 * 1024
    # execution depth (docs/limits.md): output caps, files, the timeout ladder
    max_output_bytes: int = 4 * 1024 * 1024  # stdout + stderr kept per execution
    max_result_bytes: int = 16 * 1024 * 1024  # one rich result (all its MIME types together)
    max_file_bytes: int = 256 * 1024 * 1024  # one file read or written through the files API
    default_execution_timeout: float = 0.0  # seconds; 0: a call without timeout runs unbounded
    restart_timeout: float = 60.0  # seconds a kernel restart may take before the VM is replaced
    agent_timeout: float = 10.0  # seconds the agent gets to answer before its VM is replaced
    api_keys: tuple[str, ...] = ()
    operator_keys: tuple[str, ...] = ()  # keys that may also run the cluster (nodes, drain)
    # docs/network.md: host[:port] entries every allowlist sandbox may reach (besides the host's
    # pip indexes), and that may be private addresses; outbound sandboxes too
    network_allow: tuple[str, ...] = ()
    log_format: str = "auto"  # auto | json | console
    log_level: str = "info"
    # docs/cluster.md: nodes sharing one PostgreSQL store. Empty store_url: SQLite in state_dir
    store_url: str = ""
    node_id: str = ""  # this node's name in the cluster; default: the host name
    advertise_url: str = ""  # the URL other nodes reach this one at; default: url
    cluster_secret: str = ""  # the key node-to-node signatures derive from; never sent
    node_lease_seconds: float = 15.0  # a node whose heartbeat is older is dead
    hibernate_dir: Path = Path()  # hibernated VMs; default state_dir/hibernated (shared: wake anywhere)

    def __post_init__(self) -> None:
        if self.hibernate_dir == Path():
            object.__setattr__(self, "hibernate_dir", self.state_dir / "hibernated")
        if not self.node_id:
            object.__setattr__(self, "node_id", socket.gethostname())

    @property
    def db_path(self) -> Path:
        return self.state_dir / "kernelhost.sqlite3"

    @property
    def built_image_dir(self) -> Path:
        """Where the images of the templates this service builds go: the image dir too, which
        libvirt's QEMU user can read (a state dir of mode 0700 it could not; vm-facts.md)."""
        return self.image_dir

    @property
    def accel_cache_file(self) -> Path:
        """The KVM probe's verdict (hypervisor/accel.py): a fact of the host, not of one service's
        state, so it sits in the host's image cache and every service on the host shares it."""
        return self.image_dir / ".accel.json"

    @property
    def checkpoint_dir(self) -> Path:
        return self.state_dir / "checkpoints"

    @property
    def dev_key_file(self) -> Path:
        return self.state_dir / "dev-api-key"

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(
            boot=self.boot_timeout,
            agent=self.agent_timeout,
            restart=self.restart_timeout,
            interrupt_grace=self.interrupt_grace,
            net_config=max(30.0, self.agent_timeout),
        )

    @property
    def limits(self) -> Limits:
        return Limits(
            max_code_bytes=self.max_code_bytes,
            max_output_bytes=self.max_output_bytes,
            max_result_bytes=self.max_result_bytes,
            max_file_bytes=self.max_file_bytes,
            max_frame_bytes=self.max_frame_bytes,
        )

    @property
    def max_ws_message_bytes(self) -> int:
        """One WebSocket message a client may send (code and a request's framing): the
        Kernel Gateway's WebSocket, and a cluster node's bridge of it to another node."""
        return self.max_code_bytes + 1024 * 1024

    @property
    def max_ws_relay_bytes(self) -> int:
        """One WebSocket message a node takes from another (a kernel's message: at most one
        channel frame, re-encoded with room for JSON's escapes)."""
        return 2 * self.max_frame_bytes

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def cluster(self) -> bool:
        """Whether this node shares its store with others (a PostgreSQL ``store_url``)."""
        return self.store_url.startswith(("postgresql://", "postgres://"))

    @property
    def peer_url(self) -> str:
        """Where other nodes reach this one."""
        return (self.advertise_url or self.url).rstrip("/")

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        config_file = env.get("KERNELHOST_CONFIG")
        path = Path(config_file) if config_file else DEFAULT_CONFIG_FILE
        if config_file or path.exists():
            values.update(_read_toml(path))
        for f in dataclasses.fields(cls):
            key = f"KERNELHOST_{f.name.upper()}"
            if key in env:
                values[f.name] = env[key]
        values.update(overrides)
        return cls._coerce(values, source=str(path))

    @classmethod
    def _coerce(cls, values: dict[str, Any], source: str) -> Settings:
        kwargs: dict[str, Any] = {}
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        for name, raw in values.items():
            if name not in types:
                raise ConfigError(f"unknown setting {name!r} in {source}; see docs/configuration.md")
            kind = types[name]
            try:
                if kind == "bool":
                    kwargs[name] = _bool(raw)
                elif kind == "int":
                    kwargs[name] = int(raw)
                elif kind == "float":
                    kwargs[name] = float(raw)
                elif kind == "Path":
                    kwargs[name] = Path(raw).expanduser()
                elif kind == "tuple[str, ...]":
                    items = raw.split(",") if isinstance(raw, str) else list(raw)
                    kwargs[name] = tuple(k.strip() for k in items if k.strip())
                else:
                    kwargs[name] = str(raw)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"setting {name} (KERNELHOST_{name.upper()}) has value {raw!r}, "
                    f"which is not a valid {kind}"
                ) from None
        settings = cls(**kwargs)
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.accel not in ("auto", "kvm", "tcg"):
            raise ConfigError(f"accel has value {self.accel!r}; use auto, kvm or tcg")
        if self.snapshots not in ("on", "off"):
            raise ConfigError(f"snapshots has value {self.snapshots!r}; use on or off")
        if self.live_checkpoints not in ("on", "off"):
            raise ConfigError(f"live_checkpoints has value {self.live_checkpoints!r}; use on or off")
        if self.idle_action not in ("hibernate", "delete"):
            raise ConfigError(f"idle_action has value {self.idle_action!r}; use hibernate or delete")
        if not 0 <= self.pool_size <= 256:
            raise ConfigError(f"pool_size has value {self.pool_size}; use 0-256")
        if self.log_format not in ("auto", "json", "console"):
            raise ConfigError(f"log_format has value {self.log_format!r}; use auto, json or console")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port has value {self.port}; use 1-65535")
        if self.vm_memory_mib < 256:
            raise ConfigError(f"vm_memory_mib has value {self.vm_memory_mib}; ipykernel needs >= 256")
        if not 0 <= self.vm_cpu_quota_percent <= 100:
            raise ConfigError(
                f"vm_cpu_quota_percent has value {self.vm_cpu_quota_percent}; use "
                "1-100 (percent of one host CPU per vCPU), or 0 for no cap"
            )
        if not 0 <= self.cpu_weight_per_key <= 10000:
            raise ConfigError(
                f"cpu_weight_per_key has value {self.cpu_weight_per_key}; use 1-10000 (a key's CPU "
                "weight; 100 is cgroup v2's default), or 0 for no partitions"
            )
        for name in ("max_output_bytes", "max_result_bytes", "max_file_bytes"):
            if getattr(self, name) < 1024:
                raise ConfigError(f"{name} has value {getattr(self, name)}; use at least 1024")
        if self.max_result_bytes > self.max_frame_bytes:
            raise ConfigError(
                f"max_result_bytes ({self.max_result_bytes}) cannot exceed "
                f"max_frame_bytes ({self.max_frame_bytes}); a result is one frame"
            )
        if self.default_execution_timeout < 0:
            raise ConfigError(
                f"default_execution_timeout has value "
                f"{self.default_execution_timeout}; use seconds, or 0 for none"
            )
        for name in ("restart_timeout", "agent_timeout", "interrupt_grace"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} has value {getattr(self, name)}; use a positive number of seconds")
        for name in (
            "max_requests_per_key",
            "max_connections",
            "max_metadata_bytes",
            "max_template_builds_per_key",
            "max_templates_per_key",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} has value {getattr(self, name)}; use at least 1")
        if not 1 <= self.template_build_concurrency <= 16:
            raise ConfigError(
                f"template_build_concurrency has value {self.template_build_concurrency}; use 1-16"
            )
        if not self.template_build_timeout > 0:
            raise ConfigError(
                f"template_build_timeout has value {self.template_build_timeout}; use seconds > 0"
            )
        if self.template_build_memory_mib < 512 or self.template_layer_max_mib < 64:
            raise ConfigError(
                f"template_build_memory_mib ({self.template_build_memory_mib}) must be at least 512 "
                f"and template_layer_max_mib ({self.template_layer_max_mib}) at least 64"
            )
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} has value {getattr(self, name)}; use seconds > 0")
        for name in ("max_processes_per_sandbox", "max_processes_per_key", "max_list_entries"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} has value {getattr(self, name)}; use at least 1")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both, or neither")
        self._validate_cluster()
        self._validate_admission()
        self._validate_sampling()
        weak = check_secrets(self.api_keys, self.operator_keys, self.cluster_secret, self.store_url)
        if weak:
            raise ConfigError(weak)

    @property
    def e2b_template_map(self) -> dict[str, str]:
        """``e2b_templates`` as E2B's name -> ours."""
        pairs = (entry.partition("=") for entry in self.e2b_templates)
        return {alias.strip(): template.strip() for alias, _, template in pairs}

    def _validate_admission(self) -> None:
        """What reaches a sandbox: the queue of a key at its limit, the ports' domain."""
        if self.create_queue_seconds < 0 or self.create_queue_length < 0:
            raise ConfigError(
                f"create_queue_seconds ({self.create_queue_seconds}) and create_queue_length "
                f"({self.create_queue_length}) must be 0 or more (0: a call over a limit is refused at once)"
            )
        for entry in self.e2b_templates:
            names = [name.strip() for name in entry.partition("=")[::2]]
            if not all(TEMPLATE_NAME_RE.fullmatch(name) for name in names):
                raise ConfigError(
                    f"e2b_templates has the entry {entry!r}; use e2b-name=our-template, such as "
                    "code-interpreter-v1=python-datasci (lower-case names, comma-separated)"
                )
        if self.domain and not DOMAIN_RE.fullmatch(self.domain):
            raise ConfigError(
                f"domain has value {self.domain!r}; use a lower-case DNS name without scheme or "
                "port (sandboxes.example.com), whose wildcard *.sandboxes.example.com points here"
            )

    def _validate_sampling(self) -> None:
        value = self.sandbox_metrics_interval
        if not (value == 0 or 0.5 <= value <= 3600):
            raise ConfigError(
                f"sandbox_metrics_interval has value {value}; use seconds between 0.5 and 3600 "
                "(5 is the default), or 0 to take no samples"
            )

    def _validate_cluster(self) -> None:
        if self.store_url and not self.store_url.startswith(("postgresql://", "postgres://", "sqlite:///")):
            raise ConfigError(
                "store_url must be postgresql://user:password@host/db (a cluster's shared store), "
                "sqlite:///path, or empty (SQLite in state_dir)"
            )
        if not self.node_lease_seconds >= 2:
            raise ConfigError(f"node_lease_seconds has value {self.node_lease_seconds}; use at least 2")
        if self.cluster and not self.cluster_secret:
            raise ConfigError(
                "a cluster node (a postgresql:// store_url) needs cluster_secret "
                "(KERNELHOST_CLUSTER_SECRET), the same on every node, at least "
                f"{MIN_CLUSTER_SECRET_CHARS} random characters: `openssl rand -hex 32`"
            )
        if self.advertise_url and not _is_base_url(self.advertise_url):
            raise ConfigError(
                f"advertise_url has value {self.advertise_url!r}; use http(s)://host:port, without "
                "user info, path or query (other nodes refuse a node row with them)"
            )
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", self.node_id):
            raise ConfigError(
                f"node_id has value {self.node_id!r}; use letters, digits, '.', '_' or '-' "
                "(at most 63), starting with a letter or digit"
            )


def _is_base_url(url: str) -> bool:
    """``http(s)://host[:port][/]`` and nothing else (what a node row's URL must be)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number in range)
    except ValueError:
        return False
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and parts.username is None
        and parts.password is None
        and parts.path in ("", "/")
        and not parts.query
        and not parts.fragment
    )


def _bool(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(text)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} (KERNELHOST_CONFIG) does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    section = data.get("kernelhost", data)
    if not isinstance(section, dict):
        raise ConfigError(f"config file {path}: [kernelhost] must be a table")
    return dict(section)
