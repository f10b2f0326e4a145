"""A token bucket: what a guest (or a log) may do in a burst, and how fast it earns more."""

from __future__ import annotations

import time


class TokenBucket:
    """``take()`` succeeds while tokens are left; ``rate`` tokens come back per second, up to
    ``burst``."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = time.monotonic()

    def has(self, n: float = 1.0) -> bool:
        """Whether ``take(n)`` would succeed now (nothing is taken)."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        return self._tokens >= n

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < n:
            return False
        self._tokens -= n
        return True
