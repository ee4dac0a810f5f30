"""Freed memory kept for reuse, so that a step faults no page in.

glibc's malloc hands every large block (above its mmap threshold, which is at most 32 MiB) to the
kernel when it is freed, so a step that allocates the same large tensors again (activations and
gradients of N nodes at once) gets fresh pages and faults each one in: 5 million minor page faults
and a third of the CPU time in the kernel for 100 iterations of 1,024 MLP nodes
(benchmarks/RESULTS.md). The batched engine allocates the same sizes every step; served from the
heap, and the heap not trimmed, they are reused instead."""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
KEEP = 2 ** 31 - 1  # bytes of free heap top kept before trimming (the largest value mallopt takes)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap and keep what is freed there
    (from now on, for this process); whether it did (nothing elsewhere than Linux with glibc). The
    process's memory then stays at its peak until it ends: a simulation's is its peak anyway."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP))
