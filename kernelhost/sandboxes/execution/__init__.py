"""Running one call in a sandbox: Python on its kernel or a bash command on its agent.

- ``events``: the typed events an execution yields (and their JSON form);
- ``output``: the output and result limits;
- ``calls``: what differs between Python and bash;
- ``driver``: the deadline, the timeout ladder, the loss of the VM, the consumer leaving.
"""

from .calls import iopub_event
from .driver import LANGUAGES, Cell, CellPolicy, ReplaceVm, RunningCall, run_cell
from .events import ClearOutput, End, Error, Event, Result, Stream
from .output import OutputLimits

__all__ = [
    "LANGUAGES",
    "Cell",
    "CellPolicy",
    "ClearOutput",
    "End",
    "Error",
    "Event",
    "OutputLimits",
    "ReplaceVm",
    "Result",
    "RunningCall",
    "Stream",
    "iopub_event",
    "run_cell",
]
