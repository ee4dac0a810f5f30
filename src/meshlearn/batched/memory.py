"""Freed memory kept for reuse, so that a step faults no page in.

glibc's malloc hands every large block (above its mmap threshold, which is at most 32 MiB) to the
kernel when it is freed, so a step that allocates the same large tensors again (activations and
gradients of N nodes at once) gets fresh pages and faults each one in: 5 million minor page faults
and a third of the CPU time in the kernel for 100 iterations of 1,024 MLP nodes
(benchmarks/RESULTS.md). The batched engine allocates the same sizes every step; served from the
heap, and the heap not trimmed, they are reused instead.

Threads started from then on (the workers) share the heap already there instead of each making
its own (glibc's arenas, at most one): a heap per thread keeps each thread's own peak, so their
peaks add up, where one heap holds only the most the threads use together (8 gpt-tiny nodes in
blocks of two, 8 iterations: 2.2 GB against 1.5 GB; benchmarks/RESULTS.md)."""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
KEEP = 2 ** 31 - 1  # bytes of free heap top kept before trimming (the largest value mallopt takes)


def keep_freed_memory() -> bool:
    """Ask glibc's malloc to serve every allocation from its heap, one for the threads started
    from now on, and keep what is freed there (for this process); whether it did (nothing elsewhere
    than Linux with glibc). The process's memory then stays at its peak until it ends: a
    simulation's is its peak anyway."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, KEEP)) and bool(mallopt(M_ARENA_MAX, 1))


def release_freed_memory() -> bool:
    """Give the heap's free memory back to the kernel now (glibc's ``malloc_trim``): once a run's
    training is over, what comes after (the report's figures) then starts from what is in use, not
    from the training's peak, so it does not add to it. Whether it did (Linux with glibc only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False
