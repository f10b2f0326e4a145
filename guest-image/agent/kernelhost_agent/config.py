"""Every path, switch and deadline of the agent, in one value read once at start.

``AgentConfig()`` is the guest's configuration: the virtio-serial port, ``/home/user``,
``/etc/pip.conf``, the cgroup2 root, and a clock and an entropy pool the agent may set. Tests
build one with a socketpair's fd, temporary directories, a free proxy port and the switches that
touch the machine (clock, entropy, page cache, cgroups) turned off, so the real agent can run on
a developer's host without changing it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import MutableMapping

from .accounts import Identity
from .shared import codec, log, protocol

__all__ = ["TEMPLATE_FILE", "AgentConfig", "build_vm", "guest_config"]

#: What a template's layer says about its kernel and environment (guest-image/layer.py)
TEMPLATE_FILE = "/etc/kernelhost/template.json"


def _process_environ() -> MutableMapping[str, str]:
    return os.environ


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """What the agent is wired to; the defaults are the guest's."""

    #: Name of the virtio-serial port (``/dev/virtio-ports/<name>``; found in sysfs without udev).
    port_name: str = "org.kernelhost.0"
    #: An already-open, blocking, bidirectional fd to use instead of the port (tests: one end of a
    #: socketpair). The caller keeps ownership: the agent never closes it.
    port_fd: int | None = None
    #: How long to wait for the port to appear at boot.
    port_timeout: float = 30.0
    #: The largest frame either way (the codec's limit; the host checks its own too).
    max_frame_bytes: int = codec.DEFAULT_MAX_FRAME_BYTES

    #: The kernelspec the agent starts, and where it is looked up (None: Jupyter's own path,
    #: where the image build writes ``/usr/local/share/jupyter/kernels/kernelhost``).
    kernel_name: str = "kernelhost"
    #: Start that kernel at all: off in a template's build VM (kernel command line ``kh.build``),
    #: which only runs bash commands, files and the network, so it answers ``hello`` at once.
    start_kernel: bool = True
    kernelspec_dirs: tuple[str, ...] | None = None
    #: The kernel's language: what the agent's own cells (preloads, reseeding, the network's
    #: variables) are written in (``languages.py``).
    language: str = "python"
    #: Where jupyter_client writes the kernel's connection file (None: its runtime directory,
    #: under root's home); in the guest a directory any user may pass through, as a kernel
    #: launched as the sandbox's user reads (and rewrites) its file (``accounts.py``).
    connection_file: str | None = "/run/kernelhost/kernel.json"
    #: The kernel's and bash's working directory, and the base of relative file paths.
    kernel_cwd: str = "/home/user"
    #: How long a started kernel has to answer kernel_info before start or restart fails.
    ready_timeout: float = 120.0
    #: How long a request that needs the kernel (hello, shell messages) waits for it to be ready
    #: (a start or restart in progress) before it is refused.
    request_ready_timeout: float = 300.0
    #: Code contexts (kernels of their own beside the main one, ``contexts.py``) a sandbox may
    #: have at once; ``context_start`` past it is refused.
    max_contexts: int = 8
    #: Run the kernel without message signatures (an empty key): the kernelhost kernel, whose
    #: sockets only the agent reaches (``kernel_wire.py``); None: only the "kernelhost" kernel.
    unsigned_kernel: bool | None = None
    #: Keep a second kernel started ahead, which a restart puts in place (``standby.py``): a
    #: restart in a fraction of a second, for the memory of one idle kernel.
    standby_kernel: bool = True
    #: Poll interval of the kernel monitor while a restart replaces the process.
    monitor_interval: float = 0.5
    #: The environment the kernel and bash start from; the network mode's proxy variables are set
    #: in it. The guest uses the agent's own ``os.environ``; tests pass a copy, so nothing leaks
    #: into the test process.
    environ: MutableMapping[str, str] = dataclasses.field(default_factory=_process_environ)
    #: Whose the sandbox's code is (``accounts.py``): root until the host's ``set_user``; one
    #: object, shared by the copies a code context makes of this configuration.
    identity: Identity = dataclasses.field(default_factory=Identity)

    #: Scripts and saved state of bash commands (tmpfs in the guest).
    bash_dir: str = "/run/kernelhost/bash"
    #: cgroup2 mount point for per-command groups (mounted on first use); None: do without
    #: (no memory peak, no pids limit, KILL reaches only the process group).
    cgroup_root: str | None = "/sys/fs/cgroup"

    #: pip's configuration, rewritten per network mode unless the user wrote their own.
    pip_conf: str = "/etc/pip.conf"
    #: Where ``pip install`` puts packages; added to the kernel's ``sys.path`` by net_config.
    pip_site: str = f"/usr/local/lib/python3.{sys.version_info.minor}/dist-packages"
    #: Where the in-guest HTTP proxy listens (127.0.0.1) in the modes that have one.
    proxy_port: int = protocol.PROXY_PORT

    #: What ``resumed`` and ``prepare_snapshot`` may do to the machine: set the wall clock, feed
    #: the kernel's entropy pool, sync and drop the page cache. Off in tests (they need root and
    #: would change the developer's host).
    set_clock: bool = True
    add_entropy: bool = True
    drop_caches: bool = True


def build_vm(cmdline: str = "/proc/cmdline") -> bool:
    """Whether this guest is a template's build VM (``kh.build`` on its kernel command line)."""
    try:
        with open(cmdline, encoding="utf-8") as f:
            return "kh.build" in f.read().split()
    except OSError:
        return False


def guest_config(template_file: str = TEMPLATE_FILE) -> AgentConfig:
    """The guest's configuration: the defaults, with a template's kernel, its language and its
    environment variables (set in the agent's own environment, which the kernel and bash
    commands start from) when the image has a template layer; no kernel in a build VM."""
    if build_vm():
        return AgentConfig(start_kernel=False)
    try:
        with open(template_file, encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        return AgentConfig()
    except (OSError, ValueError) as exc:
        log(f"ignoring {template_file}: {exc}")
        return AgentConfig()
    env = info.get("env") if isinstance(info, dict) else None
    if isinstance(env, dict):
        os.environ.update({str(k): str(v) for k, v in env.items()})
    kernel = info.get("kernel") if isinstance(info, dict) else None
    language = info.get("language") if isinstance(info, dict) else None
    return AgentConfig(
        kernel_name=kernel if isinstance(kernel, str) and kernel else "kernelhost",
        language=language if isinstance(language, str) and language else "python",
    )
