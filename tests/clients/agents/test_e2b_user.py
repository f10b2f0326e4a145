"""Issue 37, item 17, through the unmodified E2B SDK and real VMs: an E2B sandbox's code runs as
``user`` (uid 1000, home /home/user, sudo without a password), as on E2B; the kernel, commands
and files written through the API are that user's, so each can change what the others made; a
command or an upload may name ``root``. Sandboxes of the native API still run as root
(tests/vm/test_hostile_guest.py relies on it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ...harness import Service

pytestmark = [pytest.mark.clients, pytest.mark.timeout(600)]


@pytest.fixture
def sandbox(e2b: Service) -> Iterator[Any]:
    from e2b_code_interpreter import Sandbox

    sbx = Sandbox.create(metadata={"suite": "user"})
    try:
        yield sbx
    finally:
        sbx.kill()


def _printed(sbx: Any, code: str) -> str:
    execution = sbx.run_code(code)
    assert execution.error is None, execution.error
    return "".join(execution.logs.stdout).strip()


def test_17_code_runs_as_user_with_sudo_and_root_when_asked(sandbox: Any) -> None:
    """Commands and the kernel run as ``user`` in its home; sudo needs no password; a command
    that names ``root`` runs as root, in root's home; ``user`` cannot write where only root may."""
    from e2b import CommandExitException

    ran = sandbox.commands.run("whoami; id -u; echo $HOME; pwd; sudo -n whoami")
    shown = ran.stdout.split()
    assert shown == ["user", "1000", "/home/user", "/home/user", "root"], shown
    assert ran.stderr == "", ran.stderr  # nothing of the service's own (its cgroup move) shows
    kernel = _printed(
        sandbox,
        "import getpass, os\n"
        "print(getpass.getuser(), os.getuid(), os.getgid(), os.path.expanduser('~'), os.getcwd())",
    )
    assert kernel == "user 1000 1000 /home/user /home/user", kernel
    assert sandbox.commands.run("whoami; echo $HOME; pwd", user="root").stdout.split() == [
        "root",
        "/root",
        "/root",
    ]
    with pytest.raises(CommandExitException) as refused:
        sandbox.commands.run("touch /opt/made-by-user")
    assert "Permission denied" in refused.value.stderr, refused.value
    sandbox.commands.run("sudo touch /opt/made-by-sudo && test -O /opt/made-by-sudo || echo not-mine")
    assert _printed(sandbox, "import os\nprint(os.stat('/opt/made-by-sudo').st_uid)") == "0"


def test_17_the_kernel_commands_and_uploads_share_the_users_files(sandbox: Any) -> None:
    """A file the kernel wrote, a command can append to, and the other way round; an upload is
    the user's unless it names root; ``make_dir`` makes a directory anywhere and gives it to the
    user (as envd does: the OpenAI Agents SDK's /workspace); what a command puts in the user's
    site-packages (where ``pip install`` as the user puts packages) the running kernel imports."""
    from e2b import NotFoundException

    _printed(sandbox, "open('by-kernel.txt', 'w').write('kernel\\n')")
    sandbox.commands.run("echo command >> by-kernel.txt && echo made > by-command.txt")
    assert sandbox.files.read("by-kernel.txt") == "kernel\ncommand\n"
    assert (
        _printed(
            sandbox, "open('by-command.txt', 'a').write('kernel\\n')\nprint(open('by-command.txt').read())"
        )
        == "made\nkernel"
    )
    sandbox.files.write("uploads/by-api.txt", "api\n")
    sandbox.files.write("/root/by-root.txt", "root\n", user="root")
    owners = sandbox.commands.run(
        "echo command >> uploads/by-api.txt && stat -c %U uploads uploads/by-api.txt && "
        "sudo stat -c %U /root/by-root.txt"
    ).stdout.split()
    assert owners == ["user", "user", "root"], owners
    # as envd's Move: the destination's missing parents are made, the user's
    moved = sandbox.files.rename("by-command.txt", "moved/deeper/by-command.txt")
    assert moved.path == "/home/user/moved/deeper/by-command.txt", moved
    assert sandbox.commands.run("stat -c %U moved moved/deeper").stdout.split() == ["user", "user"]
    assert sandbox.files.read("moved/deeper/by-command.txt") == "made\nkernel\n"
    kept = sandbox.run_code("export KH_KEPT=still-here; cd /tmp", language="bash")
    assert kept.error is None, kept.error
    with pytest.raises(NotFoundException):
        sandbox.files.rename("no-such-file.txt", "elsewhere/x.txt")
    # the check for the source ran in the sandbox's shell, and left its exports and cwd as they were
    shell = sandbox.run_code("echo $KH_KEPT; pwd; cd /home/user", language="bash")
    assert "".join(shell.logs.stdout) == "still-here\n/tmp\n", shell
    # a path resolves as envd's do: ``~`` and relative paths lie in the caller's home
    sandbox.files.write("rel-by-root.txt", "root\n", user="root")
    assert sandbox.files.read("/root/rel-by-root.txt", user="root") == "root\n"
    assert "rel-by-root.txt" in [e.name for e in sandbox.files.list(".", user="root")]
    # listings and stats act as root whatever the user, as envd's: /root is 0700 to ``user``
    assert {"by-root.txt", "rel-by-root.txt"} <= {e.name for e in sandbox.files.list("/root")}
    assert sandbox.files.get_info("/root/by-root.txt").owner == "root"
    assert not sandbox.files.exists("rel-by-root.txt")  # the user's is /home/user/rel-by-root.txt
    assert sandbox.files.read("~/by-kernel.txt") == "kernel\ncommand\n"
    assert sandbox.commands.run("pwd", cwd="uploads").stdout == "/home/user/uploads\n"
    sandbox.files.make_dir("/workspace/project")  # as envd: anywhere, and the user's to fill
    made = sandbox.commands.run("touch /workspace/project/f && stat -c %U /workspace /workspace/project/f")
    assert made.stdout.split() == ["user", "user"], made.stdout
    site = sandbox.commands.run("python3 -m site --user-site").stdout.strip()
    assert site.startswith("/home/user/.local/"), site
    sandbox.commands.run(f"mkdir -p {site} && echo 'ANSWER = 42' > {site}/kh_user_module.py")
    assert _printed(sandbox, "import kh_user_module\nprint(kh_user_module.ANSWER)") == "42"


def test_17_a_paused_and_rebooted_sandbox_and_a_restarted_kernel_stay_the_users(sandbox: Any) -> None:
    """The user lives in the guest's memory (a pause keeps it), in the sandbox's record (a VM
    booted afresh, after a filesystem pause, is told again) and in every kernel started later:
    a restart's kernel (the standby, launched as root before the hand-over, drops root as it is
    promoted) and a new code context are the user's too."""
    from e2b_code_interpreter import Sandbox

    sandbox.pause()
    resumed = Sandbox.connect(sandbox.sandbox_id)
    assert resumed.commands.run("whoami").stdout.strip() == "user"
    main = next(c for c in resumed.list_code_contexts() if c.language == "python")
    resumed.restart_code_context(main)  # the main kernel: the standby, promoted
    assert _printed(resumed, "import os\nprint(os.getuid(), os.environ['HOME'])") == "1000 /home/user"
    context = resumed.create_code_context(cwd="/home/user/ctx")
    shown = resumed.run_code("import os\nprint(os.getuid(), os.getcwd())", context=context)
    assert shown.error is None and "".join(shown.logs.stdout).strip() == "1000 /home/user/ctx", shown
    owner = resumed.commands.run("stat -c %U /home/user/ctx").stdout.strip()
    assert owner == "user", owner
    resumed.restart_code_context(context)  # a kernel launched afresh, as the user
    shown = resumed.run_code("import os\nprint(os.getuid(), os.environ['HOME'])", context=context)
    assert shown.error is None and "".join(shown.logs.stdout).strip() == "1000 /home/user", shown
    resumed.pause(mode="filesystem")  # the files only: a new VM boots
    rebooted = Sandbox.connect(sandbox.sandbox_id)
    assert rebooted.commands.run("whoami").stdout.strip() == "user"
    assert _printed(rebooted, "import getpass\nprint(getpass.getuser())") == "user"
