"""Keep large receive buffers on the heap so each message does not pay for fresh pages.

libzmq allocates a buffer per received frame. glibc serves allocations above its mmap threshold
(128 KiB, rising only when such blocks are freed) with a fresh mmap: every page of every model
then faults on first touch, which costs more than the transfer itself. Fixing the threshold at
its maximum (32 MiB on 64-bit) and sending models in segments below it keeps frames in reusable
heap memory. Process-wide and glibc-only; elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
_done = False


def tune_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds once per process; returns whether it applied."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024) and libc.mallopt(M_TRIM_THRESHOLD, 256 * 1024 * 1024)
    except (OSError, AttributeError):
        return False
    _done = bool(ok)
    return _done
