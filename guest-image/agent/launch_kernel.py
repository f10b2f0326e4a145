"""Start ipykernel inside the guest (the kernelspec's argv runs this file)."""

import sys

# debugpy drags in pydevd and gdb and costs about a second of start-up under TCG; the debugger is
# not offered by kernelhost, so it is blocked before ipykernel looks for it.
sys.modules["debugpy"] = None  # type: ignore[assignment]

import kernel_limits  # noqa: E402  (per-execution output cap; see kernel_limits.py)
from ipykernel import kernelapp  # noqa: E402

kernel_limits.install()
kernelapp.launch_new_instance()
