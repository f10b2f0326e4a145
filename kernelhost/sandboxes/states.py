"""The enumerations of the sandbox layer: what a sandbox is, how an execution ended, and what
was done to bring a sandbox back. Each is a ``StrEnum``: its values are what the API, the
store and the metrics show, and a member compares equal to its value."""

from __future__ import annotations

import enum


class SandboxState(enum.StrEnum):
    STARTING = "starting"  # its VM is being made; invisible to a restarted service
    RUNNING = "running"
    HIBERNATED = "hibernated"  # saved to disk, VM stopped; its next call wakes it
    REPLACING = "replacing"  # getting a fresh VM from its template
    DEAD = "dead"  # its VM stopped and was not replaced; ``detail`` says why


class ExecutionStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"  # the code raised, or the command exited non-zero
    TIMEOUT = "timeout"  # it hit its deadline; ``Recovery`` says what stopped it
    INTERRUPTED = "interrupted"  # an interrupt request stopped it
    RESTARTED = "restarted"  # a restart request ended it
    RESTORED = "restored"  # the sandbox was rewound to a checkpoint (or a call undone) meanwhile
    KERNEL_DIED = "kernel_died"  # the kernel process, or the whole VM, was lost


class Recovery(enum.StrEnum):
    """How a sandbox was brought back after a timeout or a loss: the rungs of the ladder."""

    INTERRUPTED = "interrupted"  # KeyboardInterrupt / SIGINT; state kept
    KILLED = "killed"  # a bash command's processes were killed
    KERNEL_RESTARTED = "kernel_restarted"  # fresh kernel, same VM and files
    VM_REPLACED = "vm_replaced"  # fresh VM from the template; everything lost
    FAILED = "failed"  # nothing worked; the sandbox is dead
