"""HTTP layer: the only part of kernelhost that knows HTTP."""

from .app import init_app

__all__ = ["init_app"]
