"""Raw bash output (``bash_out`` frames) made into the Jupyter ``stream`` messages the rest of the
host reads.

An agent with capability ``raw_output`` sends the output of a command started with
``raw_output: true`` as the bytes the command wrote, spliced from its pipes to the port and never
decoded in the guest (under emulation every step of the guest's Python costs tens of times what
it costs here). ``BashOutput`` keeps one incremental UTF-8 decoder per stream of each such run
and turns every frame into the ``stream`` message an older agent sends: the same parent (the
run_id, msg_type ``bash_request``), session ``bash``, the text decoded with errors="replace",
and a character split between two frames made whole. At the run's ``bash_reply`` what the
decoders still hold (an incomplete character: U+FFFD) comes out before the reply.

Nothing in a frame is trusted. A frame of the wrong shape (a run_id that is not a string, a name
other than stdout or stderr, data that is not bytes or longer than ``BASH_OUT_MAX``) is a
protocol violation. A frame of a run the host did not start with ``raw_output`` on this channel
is dropped and counted: no state is made for it, and it reaches no subscriber. That happens
honestly too: a fork's children, and a VM restored from a checkpoint, carry on commands that the
host started on another channel until it ends them.
"""

from __future__ import annotations

import codecs
import sys
from collections import OrderedDict
from typing import Any

from .errors import ProtocolViolation
from .messages import JupyterMessage
from .protocol import BASH_OUT_MAX, BashFrame, jupyter_message

__all__ = ["MAX_RUNS", "BashOutput", "stream_message"]

#: runs remembered at once; the oldest is forgotten past this (a run whose reply never came)
MAX_RUNS = 1024
STREAMS = ("stdout", "stderr")
#: memory a stream message holds besides its text (header, parent, maps), for the queue bounds
MESSAGE_OVERHEAD = 1024


def stream_message(run_id: str, name: str, text: str) -> JupyterMessage:
    """The iopub ``stream`` message of a bash run, as the agent writes it."""
    parent = {"msg_id": run_id, "msg_type": BashFrame.REQUEST.value}
    msg = jupyter_message("stream", {"name": name, "text": text}, "bash", parent=parent)
    return JupyterMessage("iopub", msg, MESSAGE_OVERHEAD + sys.getsizeof(text))


class BashOutput:
    """The decoders of the runs whose output comes raw on one channel."""

    def __init__(self, max_runs: int = MAX_RUNS) -> None:
        self.max_runs = max_runs
        self._runs: OrderedDict[str, dict[str, codecs.IncrementalDecoder]] = OrderedDict()
        self.dropped_frames = 0
        self.dropped_bytes = 0

    def __len__(self) -> int:
        return len(self._runs)

    def expect(self, run_id: str) -> None:
        """The host is starting ``run_id`` with ``raw_output``: its frames are welcome."""
        self._runs[run_id] = {}
        self._runs.move_to_end(run_id)
        while len(self._runs) > self.max_runs:
            self._runs.popitem(last=False)

    def expects(self, run_id: str) -> bool:
        return run_id in self._runs

    def forget(self, run_id: str) -> None:
        """The run did not start (or the channel is going): later frames of it are dropped."""
        self._runs.pop(run_id, None)

    def clear(self) -> None:
        self._runs.clear()

    def decode(self, frame: dict[str, Any]) -> JupyterMessage | None:
        """The stream message of one ``bash_out`` frame; None if it has no whole character yet
        or belongs to no run of this channel. ``ProtocolViolation`` for a frame of the wrong shape."""
        run_id, name, data = frame.get("run_id"), frame.get("name"), frame.get("data")
        if not isinstance(run_id, str) or not isinstance(name, str) or name not in STREAMS:
            raise ProtocolViolation(
                f"bash_out frame without a string run_id and a name of stdout or stderr: "
                f"run_id {type(run_id).__name__}, name {str(name)[:20]!r}"
            )
        if not isinstance(data, bytes) or len(data) > BASH_OUT_MAX:
            what = f"{len(data)} bytes" if isinstance(data, bytes) else type(data).__name__
            raise ProtocolViolation(
                f"bash_out frame whose data is not bytes of at most {BASH_OUT_MAX}: {what}"
            )
        run = self._runs.get(run_id)
        if run is None:
            self.dropped_frames += 1
            self.dropped_bytes += len(data)
            return None
        decoder = run.get(name)
        if decoder is None:
            decoder = run[name] = codecs.getincrementaldecoder("utf-8")("replace")
        text = decoder.decode(data)
        return stream_message(run_id, name, text) if text else None

    def finish(self, run_id: str) -> list[JupyterMessage]:
        """The run ended (its bash_reply came): what its decoders still hold, and forget it."""
        run = self._runs.pop(run_id, None)
        if run is None:
            return []
        out = []
        for name in STREAMS:
            decoder = run.get(name)
            text = decoder.decode(b"", final=True) if decoder is not None else ""
            if text:
                out.append(stream_message(run_id, name, text))
        return out
