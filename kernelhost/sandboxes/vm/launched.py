"""What a VM launch hands back: the running VM's fresh agent, and where the time went."""

from __future__ import annotations

from dataclasses import dataclass

from ...channel import AgentClient


@dataclass(frozen=True)
class VmTimings:
    """Where the time of one launch went (seconds), for metrics, logs and benchmarks."""

    how: str = ""  # boot | clone | wake | pool
    start: float = 0.0
    attach: float = 0.0
    hygiene: float = 0.0


@dataclass(frozen=True)
class Launched:
    """A VM that runs, with its attached, fresh agent."""

    agent: AgentClient
    timings: VmTimings
