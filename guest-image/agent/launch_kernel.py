"""Start ipykernel inside the guest (the kernelspec's argv runs this file)."""

# debugpy (ipykernel's debugger) costs about a second of start-up under TCG; a template
# snapshot's kernel pays it once, before the freeze, and its clones not at all.
import kernel_limits  # per-execution output cap; see kernel_limits.py
from ipykernel import kernelapp

kernel_limits.install()
kernelapp.launch_new_instance()
