"""Warnings about what peers do wrong, logged sparsely: a peer retrying in a loop, or a flood,
must not fill the log (nor cost a line per packet)."""

from __future__ import annotations

import logging
import threading


class SparseLog:
    """Logs the 1st, 2nd, 4th, 8th, ... occurrence of each kind of event, with its count so far."""

    def __init__(self, logger: logging.Logger):
        self.logger = logger
        self.counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def warning(self, key: str, message: str, *args) -> int:
        """Count one ``key`` event; log ``message`` (with the count) if the count is a power of two."""
        with self._lock:
            count = self.counts[key] = self.counts.get(key, 0) + 1
        if count & (count - 1) == 0:
            self.logger.warning(message + " (%d so far)", *args, count)
        return count
