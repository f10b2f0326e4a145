"""``python3 -m kernelhost_agent``: the guest agent, as ``/sbin/kernelhost-init`` starts it."""

from __future__ import annotations

import asyncio
import sys

from .agent import run
from .config import guest_config


def main() -> None:
    """Run the guest's agent until the VM stops."""
    # The port's writer thread waits for the GIL after each write while the loop's thread works
    # (5 ms by default: a ceiling of 200 frames a second); a millisecond lets output flow.
    sys.setswitchinterval(0.001)
    asyncio.run(run(guest_config()))


if __name__ == "__main__":
    main()
