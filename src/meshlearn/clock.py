"""Time as a dependency: what services read and wait on, so tests can drive it instead of sleeping.

Components that expire, time out or repeat (the registry's TTL, heartbeats, leader pings, the
leader's lost-member sweep, task timeouts) take a ``Clock``. ``SYSTEM`` is the real one;
``FakeClock`` only moves when a test calls ``advance``, and its waits end when it has moved far
enough (or their event is set).
"""

from __future__ import annotations

import threading
import time


class Clock:
    """The real clock: wall time for what is stored, monotonic time for intervals, real waits."""

    def time(self) -> float:
        """Seconds since the epoch (for timestamps that outlive the process)."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for intervals and deadlines)."""
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait until ``event`` is set or ``timeout`` seconds pass; returns whether it is set."""
        return event.wait(timeout)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


SYSTEM = Clock()


class FakeClock(Clock):
    """A clock for tests: it stands still until ``advance`` moves it; waits end by fake time."""

    def __init__(self, start: float = 1_000_000.0):
        self._now = start
        self._cond = threading.Condition()

    def time(self) -> float:
        with self._cond:
            return self._now

    def monotonic(self) -> float:
        return self.time()

    def advance(self, seconds: float) -> None:
        """Move time forward, ending the waits that fall due."""
        with self._cond:
            self._now += seconds
            self._cond.notify_all()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        with self._cond:
            deadline = self._now + timeout
            while not event.is_set() and self._now < deadline:
                self._cond.wait(0.01)  # also notices an event set without telling this clock
        return event.is_set()

    def sleep(self, seconds: float) -> None:
        self.wait(threading.Event(), seconds)
