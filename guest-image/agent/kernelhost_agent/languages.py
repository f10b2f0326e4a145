"""The agent's own cells, per kernel language: loading a preload, warming up, reseeding the random
streams after a clone, and setting the network's environment in the running kernel.

Python (ipykernel) gets all of them. R (IRkernel) and bash (bash_kernel) get their equivalents.
Any other kernel gets none: its preloads are refused at build time, its random streams are its
own affair, and the network's variables reach it when it (re)starts, not while it runs.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .accounts import Account

__all__ = ["Language", "language_for"]


class Language:
    """A kernel language the agent writes no cells in."""

    name = "other"
    #: ordinary cells of each kind a user's first call takes (a value, output, an error)
    warm_up_cells: tuple[str, ...] = ()
    #: removes what the warm-up cells left (``_``, ``Out``, the last error)
    cleanup: str | None = None
    collect: str | None = None
    reseed: str | None = None
    #: the kernel's control message that does what ``reseed`` does, without a cell (cheaper)
    reseed_request: str | None = None

    def check_preload(self, name: str) -> None:
        raise ValueError(f"preloading is not supported for {self.name} kernels: {name!r:.80}")

    def load(self, name: str) -> str:
        raise ValueError(f"preloading is not supported for {self.name} kernels")

    def set_env(self, env: dict[str, str], unset: list[str], site: str) -> str | None:
        return None

    def become(self, account: Account) -> str | None:
        """The cell that makes a running kernel ``account``'s (None: it is restarted as it)."""
        return None


class Python(Language):
    name = "python"
    warm_up_cells = ("1 + 1", "print('warm')", "raise ValueError('warm')")
    # ...and no trace of them: `_`, `Out` and `_N` as in a fresh kernel, no sys.last_* error
    cleanup = (
        "import sys as _kh_s\n"
        "get_ipython().displayhook.flush()\n"
        "for _kh_n in [k for k in globals() if k[:1] == '_' and k[1:].isdigit()]:\n"
        "    del globals()[_kh_n]\n"
        "for _kh_a in ('last_type', 'last_value', 'last_traceback', 'last_exc'):\n"
        "    if hasattr(_kh_s, _kh_a):\n"
        "        delattr(_kh_s, _kh_a)\n"
        "del _kh_s, _kh_a\n"
        "if '_kh_n' in globals():\n"
        "    del _kh_n\n"
    )
    collect = "import gc as _kh_gc; _kh_gc.collect(); del _kh_gc"
    reseed = (
        "import random as _kh_r, sys as _kh_s\n"
        "_kh_r.seed()\n"
        "if 'numpy' in _kh_s.modules:\n"
        "    _kh_s.modules['numpy'].random.seed()\n"
        "del _kh_r, _kh_s"
    )
    reseed_request = "kernelhost_reseed_request"  # guest-image/agent/kernel_reseed.py

    def check_preload(self, name: str) -> None:
        if not all(part.isidentifier() for part in name.split(".")):
            raise ValueError(f"not a module name: {name!r:.200}")

    def load(self, name: str) -> str:
        return f"import {name}"

    def set_env(self, env: dict[str, str], unset: list[str], site: str) -> str:
        """The variables, and pip's install directory on the kernel's sys.path."""
        return (
            "import os as _kh_os, site as _kh_site, sys as _kh_sys\n"
            f"_kh_os.environ.update({env!r})\n"
            f"for _kh_k in {unset!r}:\n"
            "    _kh_os.environ.pop(_kh_k, None)\n"
            f"_kh_os.makedirs({site!r}, exist_ok=True)\n"
            f"if {site!r} not in _kh_sys.path:\n"
            f"    _kh_site.addsitedir({site!r})\n"
            "del _kh_os, _kh_site, _kh_sys"
        )

    def become(self, account: Account) -> str:
        """Drop root in place: groups, gid, uid (all threads: glibc sets them process-wide),
        the user's environment, and the user's site-packages where ``pip install`` as the user
        puts packages (before the system's, as at a start as the user). The process is made
        dumpable again, so the user's tools (``py-spy``, ``/proc/<pid>``) reach it."""
        return (
            "def _kh_become():\n"
            "    import ctypes, os, site, sys\n"
            f"    os.setgroups({list(account.groups)!r})\n"
            f"    os.setresgid({account.gid}, {account.gid}, {account.gid})\n"
            f"    os.setresuid({account.uid}, {account.uid}, {account.uid})\n"
            f"    os.environ.update(HOME={account.home!r}, USER={account.name!r}, LOGNAME={account.name!r})\n"
            "    ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE\n"
            "    site.USER_BASE = site.USER_SITE = None\n"
            "    user_site = site.getusersitepackages()\n"
            "    if site.ENABLE_USER_SITE is not False and user_site not in sys.path:\n"
            "        try:\n"
            "            os.makedirs(user_site, exist_ok=True)\n"
            "        except OSError:  # a home the user cannot write: nothing to install there\n"
            "            return\n"
            "        at = [i for i, p in enumerate(sys.path) if p.endswith('-packages')]\n"
            "        sys.path.insert(at[0] if at else len(sys.path), user_site)\n"
            "_kh_become()\n"
            "del _kh_become"
        )


_R_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9.]*$")


def _r_string(text: str) -> str:
    return json.dumps(text)  # a JSON string is an R string literal (\\, \", \n, \uXXXX)


class R(Language):
    name = "r"
    warm_up_cells = ("1 + 1", "print('warm')")
    collect = "invisible(gc())"
    # R seeds its generator from the clock and pid the first time it is used; a clone must not
    # keep a seed its template drew, so any is dropped
    reseed = "if (exists('.Random.seed', envir = globalenv())) rm('.Random.seed', envir = globalenv())"

    def check_preload(self, name: str) -> None:
        if not _R_NAME.match(name):
            raise ValueError(f"not an R package name: {name!r:.200}")

    def load(self, name: str) -> str:
        return f"suppressPackageStartupMessages(library({name}))"

    def set_env(self, env: dict[str, str], unset: list[str], site: str) -> str:
        lines = []
        if env:
            lines.append(
                "Sys.setenv(" + ", ".join(f"{_r_string(k)} = {_r_string(v)}" for k, v in env.items()) + ")"
            )
        if unset:
            lines.append("Sys.unsetenv(c(" + ", ".join(_r_string(k) for k in unset) + "))")
        return "\n".join(lines) or "invisible(NULL)"


class Bash(Language):
    name = "bash"
    warm_up_cells = ("echo warm",)

    def set_env(self, env: dict[str, str], unset: list[str], site: str) -> str:
        lines = [f"export {k}={_sh_quote(v)}" for k, v in env.items()]
        if unset:
            lines.append("unset " + " ".join(unset))
        return "\n".join(lines) or "true"


def _sh_quote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


_LANGUAGES: dict[str, type[Language]] = {"python": Python, "r": R, "bash": Bash}


def language_for(name: str) -> Language:
    """The language of a kernelspec's ``language`` field (``python``, ``R``, ``bash``, ...)."""
    return _LANGUAGES.get(name.lower(), Language)()
