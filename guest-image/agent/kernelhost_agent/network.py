"""The sandbox's network mode: op ``net_config``, pip.conf, and the proxy environment.

Modes: "none" (no proxy), or a proxy on 127.0.0.1 (``netproxy.py``) whose connections the host
opens through the channel ("allowlist", "outbound"). ``net_config`` is sent after every attach
(create, fork, wake, service restart): tunnels of an earlier host are dropped. It writes pip.conf
and sets the proxy environment of the kernel (now, and for kernels started later) and of bash.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from .bash import Bash
from .config import AgentConfig
from .dispatch import Handler
from .kernel import Kernel
from .languages import language_for
from .netproxy import NetProxy
from .shared import log, log_exception, protocol

__all__ = ["Network", "write_pip_conf"]

MODES = ("none", "allowlist", "outbound")
PIP_MARK = "# Written by kernelhost"
_APPLY_TIMEOUT = 30.0


class Network:
    """The network area: the mode last applied and the proxy serving it."""

    capability = protocol.Capability.NETWORK

    def __init__(
        self,
        config: AgentConfig,
        kernel: Kernel,
        bash: Bash,
        proxy: NetProxy,
        contexts: Callable[[], list[Kernel]] = list,
    ) -> None:
        self.config = config
        self.kernel = kernel
        self.contexts = contexts  # the code contexts' kernels, running: they get the cell too
        self.bash = bash
        self.proxy = proxy
        self.applied: Any = None  # (mode, env, pip) last written into the kernel and pip.conf

    def ops(self) -> Mapping[str, Handler]:
        """net_config."""
        return {protocol.Op.NET_CONFIG: self.op_net_config}

    def start(self) -> None:
        """Network mode "none" until the host says otherwise."""
        write_pip_conf(self.config.pip_conf, None, self.config.proxy_port)

    async def op_net_config(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Apply a network mode: the proxy, pip.conf, and the proxy environment."""
        mode = frame.get("mode")
        if mode not in MODES:
            raise ValueError(f"mode must be none, allowlist or outbound, got {mode!r:.80}")
        env = frame.get("env") if mode != "none" else {}
        pip = frame.get("pip") if mode != "none" else None
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and k in protocol.NET_ENV_KEYS and isinstance(v, str) for k, v in env.items()
        ):
            raise ValueError(f"env must map some of {', '.join(protocol.NET_ENV_KEYS)} to strings")
        if pip is not None and not isinstance(pip, dict):
            raise ValueError(f"pip must be a map, got {type(pip).__name__}")
        self.proxy.reset()
        if mode == "none":
            await self.proxy.stop()
        else:
            await self.proxy.listen()
        wanted = (mode, sorted(env.items()), repr(pip))
        if wanted != self.applied:
            config = None if mode == "none" else {**(pip or {}), "mode": mode}
            write_pip_conf(self.config.pip_conf, config, self.config.proxy_port)
            self._set_env(env)
            if self.config.start_kernel:
                await self._apply(self.kernel, env)
                for kernel in self.contexts():
                    try:  # one may be stopped meanwhile: the main kernel's answer is what counts
                        await self._apply(kernel, env)
                    except Exception:
                        log_exception(f"net_config: cannot set the variables in context {kernel.context_id}:")
            self.applied = wanted
        return {"listening": self.proxy.server is not None, "port": self.config.proxy_port}

    def _set_env(self, env: dict[str, str]) -> None:
        """Proxy variables for kernels started later (restarts) and for bash commands."""
        os.makedirs(self.config.pip_site, exist_ok=True)
        environ = self.config.environ
        for key in protocol.NET_ENV_KEYS:
            environ.pop(key, None)
        environ.update(env)
        self.bash.set_proxy_env(env)

    async def _apply(self, kernel: Kernel, env: dict[str, str]) -> None:
        """The same in a running kernel (for Python, also pip's install directory on its
        sys.path); nothing for a kernel language the agent writes no cells in."""
        unset = sorted(set(protocol.NET_ENV_KEYS) - set(env))
        code = language_for(kernel.config.language).set_env(env, unset, self.config.pip_site)
        if code is not None:
            await kernel.until_ready()
            await kernel.run_silent(code, timeout=_APPLY_TIMEOUT)


def write_pip_conf(path: str, pip: dict[str, Any] | None, proxy_port: int) -> None:
    """pip.conf for the network mode (None: "none"); one the user wrote is left alone."""
    try:
        with open(path) as f:
            if not f.read().startswith(PIP_MARK):
                return
    except FileNotFoundError:
        pass
    except OSError:
        return
    text = _no_network_text() if pip is None else _proxy_text(pip, proxy_port)
    try:
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    except OSError as exc:
        log("cannot write", path, exc)


def _no_network_text() -> str:
    return (
        f'{PIP_MARK}: this sandbox has no network (network mode "none").\n'
        '# Create the sandbox with network={"mode": "allowlist"} to install packages;\n'
        "# see docs/network.md of kernelhost.\n"
        "[global]\nretries = 1\ntimeout = 5\nbreak-system-packages = true\n"
    )


def _proxy_text(pip: dict[str, Any], proxy_port: int) -> str:
    lines = [
        f"{PIP_MARK} for network mode {pip.get('mode')!r}: connections go through the",
        "# proxy below, which the host checks.",
        "[global]",
        f"proxy = http://127.0.0.1:{proxy_port}",
        "break-system-packages = true",
    ]
    for key in ("index-url", "extra-index-url", "trusted-host"):
        value = pip.get(key)
        words = [value] if isinstance(value, str) else value if isinstance(value, list) else []
        # no line breaks: a value must not add lines (sections, options) of its own to the file
        words = [w for w in words if isinstance(w, str) and w and not any(c in w for c in "\r\n")]
        if words:
            lines.append(f"{key} = {' '.join(words)}")
    return "\n".join(lines) + "\n"
