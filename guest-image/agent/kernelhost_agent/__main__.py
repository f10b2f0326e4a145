"""``python3 -m kernelhost_agent``: the guest agent, as ``/sbin/kernelhost-init`` starts it."""

from __future__ import annotations

import asyncio

from .agent import run
from .config import guest_config


def main() -> None:
    """Run the guest's agent until the VM stops."""
    asyncio.run(run(guest_config()))


if __name__ == "__main__":
    main()
