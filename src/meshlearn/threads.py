"""Background threads whose failure is never silent.

A serving or receiving thread that dies of an unexpected exception used to vanish (its traceback
on stderr, its node running on half-deaf). A ``GuardedThread`` keeps the exception; its owner calls
``raise_if_failed`` from its own thread at the points it waits anyway, and ends with a clear error.
Loops that handle one input at a time recover from a bad input themselves (and count it); what
reaches the guard is a failure of the loop itself.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from meshlearn.errors import ThreadFailed

log = logging.getLogger(__name__)


class GuardedThread(threading.Thread):
    """A daemon thread that keeps the exception that ended it, for its owner to raise."""

    def __init__(self, target: Callable[..., Any], name: str, args: tuple = ()):
        super().__init__(name=name, daemon=True)
        self._work = target
        self._work_args = args
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            self._work(*self._work_args)
        except Exception as exc:  # noqa: BLE001 - kept and raised in the owner's thread
            self.failure = exc
            log.error("thread %s failed: %s: %s", self.name, type(exc).__name__, exc, exc_info=exc)

    def raise_if_failed(self) -> None:
        """Raise ``ThreadFailed`` in the calling thread if this thread died of an exception."""
        if self.failure is not None:
            raise ThreadFailed(f"the {self.name} thread failed ({type(self.failure).__name__}: {self.failure}); "
                               f"this node cannot go on") from self.failure
