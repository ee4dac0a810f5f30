"""Holding a task at the point a test needs (a spare joining, a kill mid-training, a page showing a
running task), never hoping it is still running: the test's side of ``helpers/held_models.py``.

    hold = Hold(tmp_path, 7)                        # a barrier at training step 7, up from here on
    procs.start(..., "--models-module", MODELS, "--model", "held-mlp", env=hold.env)
    hold.wait_held(procs, ["p0", "p1"])             # each waits before its 7th step
    ...                                             # whatever must happen mid-task
    hold.release()                                  # they train on

A hold holds only processes started with ``hold.env`` and only their held models; its steps are
counted per model, from a task's (or run's) first step. ``Hold(folder, 7, 40)``: two barriers,
each released on its own (the first one up first).
"""

from __future__ import annotations

import time
from pathlib import Path
from collections.abc import Callable

from helpers.netproc import Processes

MODELS = str(Path(__file__).with_name("held_models.py"))  # --models-module of the held models


class Hold:
    """Barriers at training ``steps`` of the processes started with ``env``; ``armed``: up at once
    (else from ``arm()`` on, so that a run before it trains straight through)."""

    def __init__(self, folder: Path, *steps: int, armed: bool = True):
        self.path = Path(folder) / "hold"
        self.steps = sorted(steps)
        self.up: list[int] = []
        if armed:
            self.arm()

    @property
    def env(self) -> dict[str, str]:
        """The environment of a process whose held models hold at these steps."""
        return {"HOLD_FILE": str(self.path), "HOLD_AT_STEP": ",".join(map(str, self.steps))}

    def barrier(self, step: int) -> Path:
        return Path(f"{self.path}-{step}")

    def arm(self) -> None:
        """Every barrier up (a process reaching its step waits from now on)."""
        for step in self.steps:
            self.barrier(step).touch()
        self.up = list(self.steps)

    def held(self, step: int | None = None) -> int:
        """How many processes have reached the barrier at ``step`` (the first one up), each once."""
        barrier = self.barrier(self._step(step))
        return len(list(barrier.parent.glob(f"{barrier.name}.held-*")))

    def wait_held(self, procs: Processes, names: list[str], step: int | None = None,
                  timeout: float = 240.0) -> None:
        """Until each of ``names`` (processes of ``procs``) says it waits at ``step`` (the first barrier
        up); one that exits first fails the test with its log."""
        step = self._step(step)
        for name in names:
            procs.wait_for(name, rf"held at training step {step} ", timeout=timeout)

    def wait_count(self, count: int, running: Callable[[], bool], step: int | None = None,
                   timeout: float = 240.0) -> None:
        """Until ``count`` processes wait at ``step`` (the first barrier up), for processes whose
        output the test does not read (a simulation's nodes); fails at once if ``running()`` turns false."""
        deadline = time.monotonic() + timeout
        while self.held(step) < count:
            assert running(), f"the run ended before {count} processes reached step {self._step(step)}"
            assert time.monotonic() < deadline, f"{self.held(step)} of {count} processes reached step " \
                                                f"{self._step(step)} in {timeout:.0f} s"
            time.sleep(0.05)

    def release(self, step: int | None = None) -> None:
        """Take the barrier at ``step`` (the first one up) down: those waiting there train on."""
        step = self._step(step)
        self.barrier(step).unlink(missing_ok=True)
        if step in self.up:
            self.up.remove(step)

    def release_all(self) -> None:
        for step in list(self.up):
            self.release(step)

    def _step(self, step: int | None) -> int:
        if step is not None:
            return step
        assert self.up, "no barrier is up"
        return self.up[0]
