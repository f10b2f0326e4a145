"""How the outcome of running code is shaped for a language model, shared by every adapter.

A model reads tool output as tokens, so a cell that prints a megabyte must not hand it a
megabyte. ``OutputBudget`` caps the characters a tool returns; text over the cap keeps its head
and its tail (where tracebacks and final results are) around a visible marker::

    line 1
    ...
    [... 48213 of 60000 characters truncated ...]
    ...
    ZeroDivisionError: division by zero

``shape_execution`` turns an SDK ``Execution`` into a ``ShapedExecution``: the same outcome,
ANSI colours stripped, images split out as base64 (``Image``), rendered either as one text
(``to_text``, for tools that return a string) or as separate fields (``to_dict``, for structured
tool results), each within the budget. Every adapter renders this one model in its framework's
terms (an Anthropic ``tool_result``, an Agents SDK output list, an MCP ``CallToolResult``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kernelhost.client import Execution, ExecutionStatus, Result

__all__ = [
    "DEFAULT_BUDGET",
    "IMAGE_MIME_TYPES",
    "MIN_MAX_CHARS",
    "Image",
    "OutputBudget",
    "ShapedExecution",
    "fit_texts",
    "shape_execution",
    "strip_ansi",
    "truncate_text",
]

#: The smallest ``max_chars`` accepted: below it the truncation marker would not fit.
MIN_MAX_CHARS = 100
#: MIME types handed to models as images (what vision models accept), in order of preference.
IMAGE_MIME_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")

_MARKER = "\n[... {omitted} of {total} characters truncated ...]\n"
_SHORT_MARKER = "[...{omitted} cut...]"
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")


@dataclass(frozen=True)
class OutputBudget:
    """Limits on what one tool call hands back to a model.

    ``max_chars`` caps the text (stdout, stderr, results and traceback together); text over it
    keeps a head and a tail around a truncation marker, ``head_fraction`` of the kept characters
    from the head. ``max_images`` and ``max_image_bytes`` (base64 characters, all images
    together) cap the images; images past either limit are left out and counted in the text.
    """

    max_chars: int = 20_000
    head_fraction: float = 0.5
    max_images: int = 4
    max_image_bytes: int = 8 * 1024 * 1024

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_chars, bool)
            or not isinstance(self.max_chars, int)
            or (self.max_chars < MIN_MAX_CHARS)
        ):
            raise ValueError(
                f"OutputBudget(max_chars={self.max_chars!r}): use an int of at least "
                f"{MIN_MAX_CHARS}, so the truncation marker and some output fit"
            )
        if not 0.0 <= self.head_fraction <= 1.0:
            raise ValueError(
                f"OutputBudget(head_fraction={self.head_fraction!r}): use a number from 0 (keep "
                "only the tail) to 1 (keep only the head); 0.5 keeps both halves"
            )
        if self.max_images < 0 or self.max_image_bytes < 0:
            raise ValueError(
                f"OutputBudget(max_images={self.max_images!r}, max_image_bytes="
                f"{self.max_image_bytes!r}): use 0 or more (0 sends no images)"
            )


DEFAULT_BUDGET = OutputBudget()


def truncate_text(text: str, max_chars: int, head_fraction: float = 0.5) -> str:
    """Return ``text`` if it fits in ``max_chars``; else its head and tail around a marker.

    The marker says how many characters were cut and is counted in ``max_chars``, so the
    result is never longer than ``max_chars``. Below ``MIN_MAX_CHARS`` a shorter marker is used,
    and a limit too small for even that gets a plain cut.
    """
    if max_chars < 0:
        raise ValueError(f"max_chars={max_chars!r}: use 0 or more characters")
    total = len(text)
    if total <= max_chars:
        return text
    for marker, least_kept in ((_MARKER, 20), (_SHORT_MARKER, 0)):
        # The marker's length depends on the count it shows, which depends on how much is kept:
        # start from a lower bound of the count and give up kept characters until it all fits
        # (a digit more in the count costs one character, so this loops a few times at most).
        keep = max_chars - len(marker.format(omitted=total - max_chars, total=total))
        while keep >= 0 and keep + len(marker.format(omitted=total - keep, total=total)) > max_chars:
            keep -= 1
        if keep >= least_kept:
            head = round(keep * head_fraction)
            tail = keep - head
            return text[:head] + marker.format(omitted=total - keep, total=total) + text[total - tail :]
    return text[:max_chars]


def fit_texts(texts: Sequence[str], max_chars: int, head_fraction: float = 0.5) -> tuple[list[str], bool]:
    """Share ``max_chars`` among several texts and truncate each to its share.

    Short texts keep everything; what they leave over goes to the long ones (water-filling), so
    a huge stdout does not starve a short traceback. Returns the texts and whether any was cut.
    """
    shares = [0] * len(texts)
    remaining = max_chars
    pending = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    while pending:
        fair = remaining // len(pending)
        i = pending[0]
        if len(texts[i]) <= fair:
            shares[i] = len(texts[i])
            remaining -= shares[i]
            pending.pop(0)
            continue
        for j in pending:  # every one left is longer than its fair share
            shares[j] = fair
        shares[pending[-1]] += remaining - fair * len(pending)  # the longest gets the remainder
        break
    pairs = list(zip(texts, shares, strict=True))
    out = [t if len(t) <= s else truncate_text(t, s, head_fraction) for t, s in pairs]
    return out, any(len(t) > s for t, s in pairs)


def strip_ansi(text: str) -> str:
    """Remove terminal colour and cursor escapes (IPython colours its tracebacks)."""
    return _ANSI.sub("", text)


@dataclass(frozen=True)
class Image:
    """One image output, base64 encoded as Jupyter sends it."""

    mime_type: str
    data: str

    def data_url(self) -> str:
        """The image as a ``data:`` URL."""
        return f"data:{self.mime_type};base64,{self.data}"


def _result_text(result: Result) -> str:
    """The best text rendering of a MIME bundle for a model."""
    data = result.data
    for mime in ("text/plain", "text/markdown", "text/latex"):
        value = data.get(mime)
        if isinstance(value, str):
            return value
    if isinstance(data.get("text/html"), str):
        return str(data["text/html"])
    if "application/json" in data:
        return json.dumps(data["application/json"], ensure_ascii=False)
    return f"<output of type {', '.join(data) or 'unknown'}>"


def _result_image(result: Result) -> Image | None:
    for mime in IMAGE_MIME_TYPES:
        value = result.data.get(mime)
        if isinstance(value, str) and value:
            return Image(mime, value.replace("\n", ""))
    return None


_STATUS_NOTES = {
    ExecutionStatus.TIMEOUT: "[timed out: the code ran past its time limit and was interrupted; "
    "what it had done before that is kept]",
    ExecutionStatus.KERNEL_DIED: "[the kernel died (out of memory or a crash) and was restarted: "
    "every variable and import is gone]",
    ExecutionStatus.RESTARTED: "[the kernel was restarted while this ran: every variable and import is gone]",
    ExecutionStatus.INTERRUPTED: "[interrupted before it finished]",
    ExecutionStatus.RESTORED: "[the sandbox was rewound to a checkpoint while this ran: its variables "
    "and files are as they were at that checkpoint]",
}
#: The error a bash command gets for a non-zero exit; the exit code note says it already.
_COMMAND_FAILED = "CommandFailed"


@dataclass(frozen=True)
class ShapedExecution:
    """An execution as a model should see it. Build it with ``shape_execution``."""

    status: ExecutionStatus
    execution_count: int | None
    stdout: str
    stderr: str
    result: str | None  # text of the cell's value (Jupyter's execute_result), if any
    outputs: list[str]  # text of the other rich outputs (display()), images as placeholders
    error_name: str | None
    error_value: str | None
    traceback: str | None
    exit_code: int | None  # a bash command's exit status
    images: list[Image]
    omitted_images: int
    budget: OutputBudget = field(repr=False)
    omitted_outputs: int = 0  # outputs not kept at all (a cell that displays thousands)

    @property
    def is_error(self) -> bool:
        """True when the code raised, timed out, or its kernel died."""
        return self.status != ExecutionStatus.OK or self.error_name is not None

    def _notes(self) -> list[str]:
        notes = []
        if self.status in _STATUS_NOTES:
            notes.append(_STATUS_NOTES[self.status])
        if self.exit_code is not None:
            notes.append(f"[exit code {self.exit_code}]")
        if self.omitted_images:
            notes.append(
                f"[{self.omitted_images} more image(s) not shown: over the tool's image "
                "budget; save them to files instead]"
            )
        if self.omitted_outputs:
            notes.append(
                f"[{self.omitted_outputs} more output(s) not shown: the cell displayed more than "
                f"{MAX_KEPT_RESULTS}; save them to files instead]"
            )
        return notes

    def to_text(self, *, stderr: bool = True, empty: str = "[no output]") -> str:
        """Everything in one text, at most ``budget.max_chars`` long (head and tail kept).

        ``stderr=False`` leaves stderr out (for formats that carry it apart); ``empty`` is the
        text when there is nothing to show.
        """
        parts: list[str] = []
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr and stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        parts.extend(self.outputs)
        if self.result is not None:
            label = f"Out[{self.execution_count}]" if self.execution_count is not None else "Out"
            parts.append(f"{label}: {self.result}")
        if self.traceback is not None and not (
            self.exit_code is not None and self.error_name == _COMMAND_FAILED
        ):
            parts.append(self.traceback)
        parts.extend(self._notes())
        text = "\n".join(parts) if parts else empty
        return truncate_text(text, self.budget.max_chars, self.budget.head_fraction)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-able values, all texts together within ``budget.max_chars``."""
        texts = [self.stdout, self.stderr, self.result or "", self.traceback or "", *self.outputs]
        fitted, truncated = fit_texts(texts, self.budget.max_chars, self.budget.head_fraction)
        stdout, stderr, result, traceback, *outputs = fitted
        error = None
        if self.error_name is not None:
            error = {"name": self.error_name, "value": self.error_value or "", "traceback": traceback}
        return {
            "status": str(self.status),
            "execution_count": self.execution_count,
            "stdout": stdout,
            "stderr": stderr,
            "result": result if self.result is not None else None,
            "outputs": outputs,
            "error": error,
            "exit_code": self.exit_code,
            "images": len(self.images),
            "truncated": truncated,
            "notes": self._notes(),
        }


class ResultKeeper:
    """An ``on_result`` callback that keeps what ``shape_execution`` can use, and no more: the
    images the budget attaches, every other output's text cut to the budget, and at most
    ``MAX_KEPT_RESULTS`` outputs (the rest are counted). Memory stays bounded however many
    outputs a cell produces; pass ``keep_results=False`` to ``run_code`` with it."""

    def __init__(self, budget: OutputBudget = DEFAULT_BUDGET) -> None:
        self.budget = budget
        self.results: list[Result] = []
        self.omitted = 0  # outputs past MAX_KEPT_RESULTS
        self.omitted_images = 0  # images past the budget
        self._images = 0
        self._image_bytes = 0

    def __call__(self, result: Result) -> None:
        if len(self.results) >= MAX_KEPT_RESULTS:
            self.omitted += 1
            return
        image = _result_image(result)
        if image is not None:
            fits = (
                self._images < self.budget.max_images
                and self._image_bytes + len(image.data) <= self.budget.max_image_bytes
            )
            if fits:
                self._images += 1
                self._image_bytes += len(image.data)
                self.results.append(Result({image.mime_type: image.data}, {}, result.is_main_result))
            else:
                self.omitted_images += 1
                placeholder = f"<image: {image.mime_type}, not attached>"
                self.results.append(Result({"text/plain": placeholder}, {}, result.is_main_result))
            return
        text = truncate_text(_result_text(result), self.budget.max_chars, self.budget.head_fraction)
        self.results.append(Result({"text/plain": text}, {}, result.is_main_result))

    def into(self, execution: Execution) -> Execution:
        """``execution`` with the kept results (those ``run_code`` did not keep itself)."""
        execution.results = list(self.results)
        return execution


#: outputs of one call a ResultKeeper keeps (the text budget would cut the rest anyway)
MAX_KEPT_RESULTS = 64


def shape_execution(
    execution: Execution, budget: OutputBudget = DEFAULT_BUDGET, kept: ResultKeeper | None = None
) -> ShapedExecution:
    """Shape an SDK ``Execution`` for a model (see the module docstring); ``kept``: the
    ``ResultKeeper`` that collected its results, if one did."""
    if kept is not None:
        execution = kept.into(execution)
    images: list[Image] = []
    omitted = kept.omitted_images if kept is not None else 0
    image_bytes = 0
    outputs: list[str] = []
    main: str | None = None
    for result in execution.results:
        image = _result_image(result)
        if image is not None:
            fits = len(images) < budget.max_images and image_bytes + len(image.data) <= budget.max_image_bytes
            if fits:
                images.append(image)
                image_bytes += len(image.data)
                text = f"<image {len(images)}: {image.mime_type}, attached>"
            else:
                omitted += 1
                text = f"<image: {image.mime_type}, not attached>"
        else:
            text = strip_ansi(_result_text(result))
        if result.is_main_result:
            main = text
        else:
            outputs.append(text)
    error = execution.error
    traceback = None
    if error is not None:
        lines = [strip_ansi(line) for line in error.traceback]
        traceback = "\n".join(lines) if lines else f"{error.name}: {error.value}"
    return ShapedExecution(
        status=execution.status,
        execution_count=execution.execution_count,
        stdout=strip_ansi(execution.stdout),
        stderr=strip_ansi(execution.stderr),
        result=main,
        outputs=outputs,
        error_name=error.name if error else None,
        error_value=error.value if error else None,
        traceback=traceback,
        exit_code=execution.exit_code,
        images=images,
        omitted_images=omitted,
        omitted_outputs=kept.omitted if kept is not None else 0,
        budget=budget,
    )
