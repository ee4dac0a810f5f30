"""Waiting in tests on a condition, never on a fixed sleep."""

from __future__ import annotations

import time
from typing import Callable


def wait_until(condition: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (its last value)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return bool(condition())
