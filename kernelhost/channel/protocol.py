"""What the host service and the guest agent agree on, besides the framing (``codec``).

Like ``codec``, this module is shared: the host imports it as ``kernelhost.channel.protocol``
and the guest image build copies it verbatim next to the agent, which imports it as
``protocol``. It therefore depends on the standard library alone.

Frames are msgpack maps whose ``"op"`` is a ``Frame`` kind or, for a request from the host, an
``Op``. A request carries an integer ``id`` and is answered by one ``{"op": "reply", "id": N,
"ok": bool, ...}``. The agent's ``hello`` reply lists its ``capabilities``: the host uses an op
only if the agent announced the capability that op belongs to (``CAPABILITY_OF``), instead of
trying it and reading the error.
"""

from __future__ import annotations

import datetime
import enum
import uuid
from typing import Any

__all__ = [
    "AGENT_PROTOCOL",
    "BASH_OUT_MAX",
    "CAPABILITY_OF",
    "CONTEXT_NOT_FOUND",
    "JUPYTER_PROTOCOL_VERSION",
    "LEGACY_CAPABILITIES",
    "NET_CHUNK",
    "NET_ENV_KEYS",
    "NET_WINDOW",
    "PROXY_PORT",
    "BashFrame",
    "Capability",
    "Event",
    "Frame",
    "NetFrame",
    "NetRefusal",
    "Op",
    "jupyter_header",
    "jupyter_message",
]

#: Version of this protocol; the agent reports it in ``hello`` as ``agent_version``.
AGENT_PROTOCOL = 2
#: The Jupyter messaging protocol version that ipykernel in the guest speaks (and that the
#: headers written by the host and the agent carry).
JUPYTER_PROTOCOL_VERSION = "5.3"


class Frame(enum.StrEnum):
    """Frame kinds that are not requests."""

    REPLY = "reply"  # agent -> host: the answer to one request
    #: both ways: one Jupyter message {"channel", "msg"}, and "context" if it is to or from a
    #: code context's kernel (none: the main kernel's)
    JUPYTER = "jupyter"
    NET = "net"  # both ways: one frame of a network tunnel (``NetFrame``)
    EVENT = "event"  # agent -> host: something happened (``Event``)
    #: agent -> host: raw output bytes of a bash run started with ``raw_output``
    #: {run_id, name: "stdout" | "stderr", data: bin of at most BASH_OUT_MAX bytes}; the host
    #: decodes them (UTF-8, a character may span frames) into Jupyter ``stream`` messages
    BASH_OUT = "bash_out"


class Op(enum.StrEnum):
    """Requests the host sends to the agent."""

    #: answered once the kernel is ready: version, capabilities, kernel_info, and (agents with
    #: ``Capability.CONTEXTS``) the installed kernelspecs ``kernels: [{name, language}]``
    HELLO = "hello"
    PING = "ping"
    INTERRUPT = "interrupt"  # SIGINT to the kernel
    RESTART = "restart"  # a fresh kernel process (same VM, same files)
    BASH = "bash"  # start one bash command {run_id, command, max_output_bytes, raw_output}
    BASH_SIGNAL = "bash_signal"  # {run_id | None, signal: INT | TERM | KILL}
    BASH_RESET = "bash_reset"  # kill every command, forget the shell's cwd and exports
    BASH_INPUT = "bash_input"  # {run_id, data: bytes, eof}: to the stdin of a command run with stdin
    FS_STAT = "fs_stat"
    FS_READ = "fs_read"
    FS_WRITE = "fs_write"
    FS_RENAME = "fs_rename"
    FS_LIST = "fs_list"
    FS_REMOVE = "fs_remove"
    NET_CONFIG = "net_config"  # the sandbox's network mode: proxy, pip.conf, environment
    PREPARE_SNAPSHOT = "prepare_snapshot"  # warm up before the VM is frozen into a template
    RESUMED = "resumed"  # after a clone, wake or fork: clock, entropy, RNG seeds
    WARM_UP = "warm_up"  # a pooled clone's first cells, before it is handed out (no trace)
    #: a kernel of its own {kernel?: kernelspec name, cwd?: absolute path}, answered
    #: {context, kernel, language, cwd, default} once it is ready (``Capability.CONTEXTS``);
    #: ``default: true`` marks its language's default context (kept and listed, nothing more)
    CONTEXT_START = "context_start"
    CONTEXT_STOP = "context_stop"  # {context}: shut its kernel down and forget it
    CONTEXT_RESTART = "context_restart"  # {context}: a fresh kernel process; answered {kernel_info}
    CONTEXT_INTERRUPT = "context_interrupt"  # {context}: SIGINT to its kernel
    CONTEXT_LIST = "context_list"  # answered {contexts: [{context, kernel, language, cwd, default}]}
    #: {user}: the sandbox's code runs as this account of the image from now on (its kernel,
    #: later kernels, commands, files written); answered {user, uid, gid, home}. ``bash`` and
    #: ``fs_write`` then take an optional ``user`` ("root", or the sandbox's) of their own
    SET_USER = "set_user"


class Event(enum.StrEnum):
    """``{"op": "event", "event": ...}`` frames of the agent; those of a context's kernel carry
    its ``context`` (the main kernel's carry none)."""

    KERNEL_DIED = "kernel_died"  # {exit_code}; the agent restarts the kernel on its own
    KERNEL_RESTARTED = "kernel_restarted"  # {reason: "died" | "requested"}


class NetFrame(enum.StrEnum):
    """The ``t`` field of a ``net`` frame; every one names its ``tunnel``: an id of the guest
    (above 0) for a connection the guest opens out, an id of the host (below 0) for one the host
    opens to a port in the guest (``Capability.INGRESS``)."""

    OPEN = "open"  # guest -> host {host, port}
    OPENED = "opened"  # host -> guest {ok, reason (a NetRefusal), error}; guest -> host {ok, error}
    CONNECT = "connect"  # host -> guest {port}: connect to 127.0.0.1:port in the guest
    DATA = "data"  # both ways {data}; at most NET_WINDOW unacknowledged bytes per direction
    ACK = "ack"  # both ways {n}: bytes of the other side's data written out
    CLOSE = "close"  # both ways


class NetRefusal(enum.StrEnum):
    """Why the host refused to open a tunnel (the ``reason`` of a failed ``opened``); the
    guest's proxy turns it into its HTTP answer."""

    POLICY = "policy"  # the sandbox's network mode or allowlist forbids the destination
    INVALID = "invalid"  # the request named no usable host or port
    UNREACHABLE = "unreachable"  # the name did not resolve, or the connection failed
    BUSY = "busy"  # the sandbox has too many connections open


class BashFrame(enum.StrEnum):
    """Jupyter-shaped messages of a bash command, whose parent ``msg_id`` is its ``run_id``."""

    REQUEST = "bash_request"  # the parent's msg_type
    REPLY = "bash_reply"  # shell: {exit_code, signal, failure, cpu_ms, peak_memory_bytes}


class Capability(enum.StrEnum):
    """What an agent can do beyond relaying Jupyter messages, announced in ``hello``."""

    BASH = "bash"
    #: commands with a stdin (``bash`` with ``stdin: true``, ``bash_input``) and commands that
    #: leave the shell's state alone (``keep_state: false``), for background processes
    PROCESSES = "processes"
    FILES = "files"
    NETWORK = "network"
    SNAPSHOT = "snapshot"
    WARM_UP = "warm_up"
    #: ``bash`` with ``raw_output: true`` sends the command's output as ``bash_out`` frames of
    #: raw bytes (spliced from its pipe to the port) instead of ``stream`` messages
    RAW_OUTPUT = "raw_output"
    #: ``net`` frames ``connect`` (host -> guest, a tunnel id below 0): a connection of the
    #: host's to a port a server in the guest listens on (docs/ports.md)
    INGRESS = "ingress"
    #: code contexts: kernels of their own beside the main one (``context_*`` ops); a
    #: ``jupyter`` frame with ``context`` goes to (and one from it comes from) that context's
    #: kernel (the agent's ``contexts.py``)
    CONTEXTS = "contexts"
    #: ``set_user``, and a ``user`` of ``bash`` and ``fs_write`` (the agent's ``accounts.py``)
    USERS = "users"


#: The capability each optional op needs; ops not listed every agent has.
CAPABILITY_OF: dict[Op, Capability] = {
    Op.BASH: Capability.BASH,
    Op.BASH_SIGNAL: Capability.BASH,
    Op.BASH_RESET: Capability.BASH,
    Op.BASH_INPUT: Capability.PROCESSES,
    Op.FS_STAT: Capability.FILES,
    Op.FS_READ: Capability.FILES,
    Op.FS_WRITE: Capability.FILES,
    Op.FS_RENAME: Capability.FILES,
    Op.FS_LIST: Capability.FILES,
    Op.FS_REMOVE: Capability.FILES,
    Op.NET_CONFIG: Capability.NETWORK,
    Op.PREPARE_SNAPSHOT: Capability.SNAPSHOT,
    Op.RESUMED: Capability.SNAPSHOT,
    Op.WARM_UP: Capability.WARM_UP,
    Op.SET_USER: Capability.USERS,
    Op.CONTEXT_START: Capability.CONTEXTS,
    Op.CONTEXT_STOP: Capability.CONTEXTS,
    Op.CONTEXT_RESTART: Capability.CONTEXTS,
    Op.CONTEXT_INTERRUPT: Capability.CONTEXTS,
    Op.CONTEXT_LIST: Capability.CONTEXTS,
}

#: The ``ename`` of the error the agent answers a shell or control request with when its
#: ``jupyter`` frame names a context the agent does not have (stopped, or never started).
CONTEXT_NOT_FOUND = "ContextNotFound"

#: What an agent of protocol 1 (which announced no capabilities) could do.
LEGACY_CAPABILITIES = frozenset({Capability.BASH, Capability.FILES, Capability.NETWORK, Capability.SNAPSHOT})

#: The largest ``data`` of one ``bash_out`` frame; a larger one is a protocol violation.
BASH_OUT_MAX = 2 << 20

# -- network tunnels ---------------------------------------------------------------------------

#: Where the guest's HTTP proxy listens (127.0.0.1), in the network modes that have one.
PROXY_PORT = 3128
#: Unacknowledged bytes per tunnel and direction.
NET_WINDOW = 256 * 1024
#: The largest ``data`` payload of one net frame.
NET_CHUNK = 64 * 1024
#: Environment variables that carry the proxy settings into the kernel and bash.
NET_ENV_KEYS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "http_proxy",
    "https_proxy",
    "NO_PROXY",
    "no_proxy",
    "ALL_PROXY",
    "all_proxy",
)

# -- Jupyter messages written by kernelhost itself -----------------------------------------------


def jupyter_header(
    msg_type: str, session: str, msg_id: str | None = None, username: str = "kernelhost"
) -> dict[str, Any]:
    """A Jupyter message header, as ipykernel writes them."""
    return {
        "msg_id": msg_id or uuid.uuid4().hex,
        "msg_type": msg_type,
        "session": session,
        "username": username,
        "date": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": JUPYTER_PROTOCOL_VERSION,
    }


def jupyter_message(
    msg_type: str,
    content: dict[str, Any],
    session: str,
    *,
    msg_id: str | None = None,
    parent: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A whole Jupyter message in the channel's map form (header, parent, metadata, content)."""
    return {
        "header": jupyter_header(msg_type, session, msg_id),
        "parent_header": dict(parent or {}),
        "metadata": dict(metadata or {}),
        "content": content,
        "buffers": [],
    }
