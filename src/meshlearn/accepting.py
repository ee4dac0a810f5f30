"""What every listener of a service does when accept() fails for want of descriptors or memory:
it stops accepting for a moment (the pending connection stays queued in the kernel, so a listener
that kept trying would spin), says so in one line, and then accepts again. The relay's ports
(``network.channel.splicer``), the dashboard and the RPC servers (``network.channel.rpc``) all rest this way."""

from __future__ import annotations

import errno
import logging
import os

from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)
_pauses = SparseLog(log)  # shared by every listener of the process: one shortage is not a line per port

SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})  # accept() out of descriptors or memory
ACCEPT_PAUSE = 0.25  # seconds a listener rests after accept() failed (out of descriptors or memory)


def say_paused(name: str, error: OSError | int, seconds: float) -> None:
    """Log that listener ``name`` stopped accepting for ``seconds`` because accept() failed with
    ``error`` (an OSError or an errno): one line per pause at most, the 1st, 2nd, 4th, ... pause
    of the process, with its count (a long shortage must not fill the log)."""
    number = error.errno if isinstance(error, OSError) else error
    text = error.strerror if isinstance(error, OSError) and error.strerror else os.strerror(number or 0)
    why = "out of descriptors or memory" if number in SHORTAGE else "accept failed"
    _pauses.warning(why, "%s: %s (%s): accepting paused for %g s", name, why, text, seconds)
