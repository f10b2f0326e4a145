"""structlog configuration, done once at start-up (``configure``).

JSON lines when stderr is not a terminal, readable console output when it is. Request handlers
bind ``sandbox_id`` and ``key_id`` with ``structlog.contextvars``; never the key itself.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog

from .progress import TerminalAware

_console = False  # whether logs are rendered for a person at a terminal (not JSON)


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
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        # through TerminalAware, log lines on a terminal go above a progress bar, not into it
        logger_factory=structlog.PrintLoggerFactory(
            file=cast(TextIO, TerminalAware(sys.stderr)) if _console else sys.stderr
        ),
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=max(lvl, logging.WARNING), stream=sys.stderr, format="%(name)s: %(message)s")
