"""The threads that train the batched engine's nodes, and how many of them a run uses.

Every node's step runs on a worker thread with one torch intra-op thread, so a node's arithmetic
is the same whatever the number of workers (a convolution's result depends on its intra-op
threads): the count changes the speed of a run, never its results. Workers block on a queue
between steps instead of spinning as OpenMP threads do, so a loaded machine slows a run without
the spikes that oversubscribed intra-op threads gave.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

Job = TypeVar("Job")


@contextlib.contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """Inside the block, the calling thread's torch ops use ``count`` intra-op threads (None: as they were)."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def available_cores() -> int:
    """CPU cores this process may run on, shared among the processes ``torchrun`` started on this machine."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


class WorkerChoice:
    """How many workers the next step uses: a fixed count, or (``auto``) each candidate in turn for
    ``trials`` steps, then for good the one whose median step took least time. The steps timed are
    the run's own (nothing is computed twice), and since the count never changes results, the
    choice, which follows the machine's load, does not either."""

    def __init__(self, candidates: Sequence[int], trials: int = 3):
        if not candidates:
            raise ValueError("WorkerChoice needs at least one candidate worker count")
        self.candidates = sorted(set(candidates))
        self.trials = trials
        self.times: dict[int, list[float]] = {count: [] for count in self.candidates}
        self.chosen: int | None = self.candidates[0] if len(self.candidates) == 1 else None

    def next(self) -> int:
        """The worker count for the next step."""
        if self.chosen is not None:
            return self.chosen
        return min(self.candidates, key=lambda count: len(self.times[count]))

    def record(self, count: int, seconds: float) -> None:
        """A step on ``count`` workers took ``seconds``; choose once every candidate has its trials."""
        if self.chosen is not None:
            return
        self.times[count].append(seconds)
        if all(len(times) >= self.trials for times in self.times.values()):
            self.chosen = min(self.candidates, key=lambda c: (statistics.median(self.times[c]), c))


class Workers:
    """Up to ``count`` threads with one intra-op thread each, started on first use. ``run`` splits
    a step's jobs into contiguous parts, one per worker, each done with that worker's own copy of
    some per-thread state (``make``: e.g. a model, which ``functional_call`` rebinds, so threads
    may not share one). ``close`` stops a part in progress after its current job: Ctrl-C in the
    middle of a step waits for one job (a block of nodes), not for the rest of the step."""

    def __init__(self, count: int, make: Callable[[], object]):
        self.count = count
        self._make = make
        self._own: list[object] = []
        self._pool: ThreadPoolExecutor | None = None
        self._stopping = threading.Event()  # set by close: the parts of the run in progress stop

    def run(self, work: Callable[[object, Iterable[Job]], None], jobs: list[Job], workers: int) -> None:
        """Do ``jobs`` on ``workers`` threads (at most ``count``), in order within each part (``work``
        is given a worker's state and its part, which ends early once ``close`` is called); wait
        for all, then raise the first failure."""
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.count, thread_name_prefix="meshlearn-worker",
                                            initializer=torch.set_num_threads, initargs=(1,))
        workers = max(1, min(workers, self.count, len(jobs)))
        while len(self._own) < workers:
            self._own.append(self._make())
        futures: list[Future] = []
        for index in range(workers):
            part = jobs[len(jobs) * index // workers:len(jobs) * (index + 1) // workers]
            futures.append(self._pool.submit(work, self._own[index], _until(self._stopping, part)))
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        """Stop the threads, each once its current job is done (a later ``run`` starts them again)."""
        stopping, self._stopping = self._stopping, threading.Event()  # a later run's parts do not stop
        stopping.set()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _until(stopping: threading.Event, part: list[Job]) -> Iterator[Job]:
    """The jobs of ``part``, one by one, until ``stopping`` is set."""
    for job in part:
        if stopping.is_set():
            return
        yield job
