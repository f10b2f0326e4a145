"""structlog configuration, done once at start-up (``configure``).

JSON lines when stderr is not a terminal, readable console output when it is. Request handlers
bind ``sandbox_id`` and ``key_id`` with ``structlog.contextvars``; never the key itself. With
tracing on, a line written inside a span names its ``trace_id`` and ``span_id`` (docs/tracing.md). A key
that came in a URL (``?token=``, the Kernel Gateway routes) is redacted from every line
(``redact``), structlog's and the standard library's alike.
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO, cast

import structlog

from . import tracing
from .progress import TerminalAware

_console = False  # whether logs are rendered for a person at a terminal (not JSON)
_TOKEN_IN_TEXT = re.compile(r"(?i)(token=)[^&\s#'\"]+")


def redact(text: str) -> str:
    """``text`` with every ``token=<value>`` (``?token=``, ``access_token=``, ...) replaced by
    ``token=[redacted]``."""
    return _TOKEN_IN_TEXT.sub(r"\1[redacted]", text)


def _redact_event(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for name, value in event.items():
        if isinstance(value, str):
            event[name] = redact(value)
    return event


def _trace_context(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """The span a line was written in, so a trace and its log lines find each other."""
    ids = tracing.current_ids()
    if ids is not None:
        event.setdefault("trace_id", ids[0])
        event.setdefault("span_id", ids[1])
    return event


class RedactingFormatter(logging.Formatter):
    """The standard library's lines (aiohttp's, say), tracebacks included, redacted."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


def console() -> bool:
    """Whether the logs go to a terminal in readable form: progress bars may be drawn there."""
    return _console


def configure(fmt: str = "auto", level: str = "info") -> None:
    lvl = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    global _console
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    _console = not use_json and sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _trace_context,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            _redact_event,  # after the traceback became text: it may quote a URL too
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # through TerminalAware, log lines on a terminal go above a progress bar, not into it
        logger_factory=structlog.PrintLoggerFactory(
            file=cast(TextIO, TerminalAware(sys.stderr)) if _console else sys.stderr
        ),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr:
            handler.setFormatter(RedactingFormatter("%(name)s: %(message)s"))
