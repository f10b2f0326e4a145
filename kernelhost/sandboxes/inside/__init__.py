"""Inside a running sandbox: what the service does in its VM through the guest agent.

- ``files``: ``FileService``: transfers (windowed chunks), listings, removal, the guest's errors;
- ``processes``: ``Processes``: background commands, their output, input and signals;
- ``contexts``: ``CodeContexts``: code contexts, kernels of their own beside the main one;
- ``ports``: ``Ports``: a connection to a server listening in the sandbox (``api/ports.py``);
- ``usage``: ``UsageMeter``: a sandbox's CPU, memory and disk now;
- ``accounts``: ``set_user``: the account its code runs as, told to a VM it gets.

Each wakes a hibernated sandbox and waits for a VM replacement in flight, and none queues behind
a running execution (a code context's cells run through ``execution/``, as the main kernel's).
"""

from .accounts import set_user
from .contexts import CodeContext, CodeContexts
from .files import FileService, WaitForVm
from .ports import Ports
from .processes import Process, Processes, stop_processes
from .usage import UsageMeter

__all__ = [
    "CodeContext",
    "CodeContexts",
    "FileService",
    "Ports",
    "Process",
    "Processes",
    "UsageMeter",
    "WaitForVm",
    "set_user",
    "stop_processes",
]
