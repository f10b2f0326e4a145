"""How one bash command's process starts: the prelude it runs, and the user it runs as.

In a sandbox with a user (``accounts.py``) a command runs as that user unless its request names
root, with the HOME, USER and LOGNAME of the one it runs as; the files it opens as the user (its
script, a standby's go) are given to that user, and the agent moves it into its cgroup (a user
cannot move itself there).
"""

from __future__ import annotations

import subprocess
from typing import Any

from . import bashstandby
from .accounts import ROOT, Account, Identity
from .cgroups import Cgroups

__all__ = ["PRELUDE", "spawn"]

# $1: where the EXIT trap saves the working directory and the exported environment (NUL-separated,
# the directory first, then STATE_END: a state cut short, its trap killed, lacks it); $2: the file
# holding the command, run by eval so errors read "bash: ...". Under emulation every process bash
# starts costs tens of milliseconds of each call, so the prelude and the trap start none: they
# read the command with `read`, list the exported variables with `compgen -e` (set ones, not
# arrays), and only when a function is exported (which `env -0` writes as bash passes it on)
# take `env -0`. What they would print on stderr (`set -x` in the command) goes to /dev/null. A
# standby (bashstandby.py) gets this far ahead of its command, then waits for its go.
PRELUDE = r"""__kh_state=$1 __kh_cmd=$2 __kh_go=$4
# $3: the run's cgroup, or empty; a user's bash may not move itself (the agent moves it), and
# a redirection that fails reports before a 2>/dev/null after it applies: the group's braces
[ -z "$3" ] || { echo $$ >"$3/cgroup.procs"; } 2>/dev/null
set --
__kh_save() {
    {
        local IFS=$' \t\n' __kh_a __kh_n __kh_names __kh_fx=
        compgen -e >"$__kh_state.names" || :
        declare -F >"$__kh_state.funcs" || :
        while read -r __kh_a __kh_a __kh_n; do
            [[ $__kh_a == -fx ]] && __kh_fx=1
        done <"$__kh_state.funcs"
        mapfile -t __kh_names <"$__kh_state.names"
        {
            printf '%s\0' "$PWD"
            if [[ -n $__kh_fx ]]; then
                env -0
            else
                for __kh_n in "${__kh_names[@]}"; do
                    [[ -v $__kh_n && ${!__kh_n@a} != *[aA]* ]] && printf '%s=%s\0' "$__kh_n" "${!__kh_n}"
                done
            fi
            printf '__kh_end\0'
        } >"$__kh_state"
    } 2>/dev/null
}
# $4: a standby's FIFO (bashstandby), whose line says the command is in $2; or empty
[ -z "$__kh_go" ] || read -r __kh_go <"$__kh_go" || exit 1
trap '{ set +x; } 2>/dev/null; __kh_save' EXIT
IFS= read -r -d '' __kh_code <"$__kh_cmd"
eval "$__kh_code"
"""


def spawn(
    args: list[str],
    env: dict[str, str],
    cwd: str,
    stdin: bool,
    account: Account | None,
    identity: Identity,
    cgroups: Cgroups,
) -> subprocess.Popen[bytes]:
    """bash on the prelude (``args``: its $1 to $4), in a session of its own, as ``account``
    (None: root)."""
    extra: dict[str, Any] = {}
    if identity.account is not None:
        env = (account or ROOT).environ(env)
    if account is not None:
        extra = account.popen()
        for path in (args[1], args[3]):  # its script and its go, which it opens as the user
            if path:
                account.own(path)
    proc = subprocess.Popen(  # reaped by wait_process (pidfd), not by Popen
        [bashstandby.BASH, "--noprofile", "--norc", "-c", PRELUDE, "bash", *args],
        executable=bashstandby.executable(),
        stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=cwd,
        env=env,
        start_new_session=True,
        close_fds=True,
        bufsize=0,
        **extra,
    )
    if account is not None:
        cgroups.join(args[2], proc.pid)  # the prelude's own move needs root
    return proc
