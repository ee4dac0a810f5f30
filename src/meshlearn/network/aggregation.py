"""Leader aggregation (CloudMesh's design, finished): the leader keeps every provider's latest model.

A follower pushes its model every aggregation cycle and gets the average back at once; only
the very first cycle waits (up to the peer timeout) for everyone, so that all start from one
model. A provider silent for longer than the peer timeout is counted lost and left out of the
average, so a dead follower never blocks the leader. Until then a model counts less the staler it
is (weight = samples / (1 + rounds behind), FedAsync's polynomial rule): a follower that stalls
or dies stops dragging the others back long before it is declared lost.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch


@dataclass
class Contribution:
    """What one provider gave the task: samples in its shard and models pushed."""

    samples: int = 0
    updates: int = 0
    finished: bool = False
    lost: bool = False
    last_seen: float = field(default_factory=time.monotonic)


class LeaderState:
    """The leader's view of the task: latest model and contribution of every provider, by index."""

    def __init__(self, expected: list[int], peer_timeout: float, barrier: bool):
        self.expected = list(expected)
        self.peer_timeout = peer_timeout
        self.latest: dict[int, torch.Tensor] = {}
        self.clock = 0  # models received so far
        self.stored_at: dict[int, int] = {}
        self.contributions: dict[int, Contribution] = {i: Contribution() for i in expected}
        self._cond = threading.Condition()
        self._first_cycle_open = barrier
        self._started = time.monotonic()

    def touch(self, index: int) -> None:
        """A sign of life from provider ``index`` (a push or a ping)."""
        with self._cond:
            contribution = self.contributions.setdefault(index, Contribution())
            contribution.last_seen = time.monotonic()

    def _sweep(self) -> None:
        now = time.monotonic()
        for contribution in self.contributions.values():
            if not contribution.finished and now - contribution.last_seen > self.peer_timeout:
                contribution.lost = True

    def mark_lost(self, index: int) -> None:
        with self._cond:
            self.contributions.setdefault(index, Contribution()).lost = True
            self._cond.notify_all()

    def submit(self, index: int, state: torch.Tensor, samples: int, final: bool) -> torch.Tensor:
        """Record provider ``index``'s latest state; return the sample-weighted average of all latest states."""
        with self._cond:
            contribution = self.contributions.setdefault(index, Contribution())
            contribution.samples = samples
            contribution.updates += 1
            contribution.finished = contribution.finished or final
            contribution.lost = False
            contribution.last_seen = time.monotonic()
            self.latest[index] = state.detach().to("cpu", copy=True)
            self.clock += 1
            self.stored_at[index] = self.clock
            self._cond.notify_all()
            if self._first_cycle_open:
                deadline = self._started + self.peer_timeout
                while not self._everyone_in() and time.monotonic() < deadline:
                    self._cond.wait(timeout=0.05)
                self._first_cycle_open = False
                self._cond.notify_all()
            return self._average()

    def has_final(self, index: int) -> bool:
        with self._cond:
            return index in self.contributions and self.contributions[index].finished

    def _everyone_in(self) -> bool:
        self._sweep()
        return all(i in self.latest or self.contributions[i].lost for i in self.expected)

    def _average(self) -> torch.Tensor:
        self._sweep()
        members = [i for i in self.latest if not self.contributions[i].lost]
        behind = {i: (self.clock - self.stored_at[i]) / len(members) for i in members}
        weights = [max(1, self.contributions[i].samples) / (1.0 + behind[i]) for i in members]
        total = float(sum(weights))
        result = torch.zeros_like(self.latest[members[0]])
        for i, w in zip(members, weights):
            result.add_(self.latest[i], alpha=w / total)
        return result

    def wait_for_finals(self, poll: float = 0.05) -> torch.Tensor:
        """Block until every provider has pushed its final model or is lost; return the final average."""
        with self._cond:
            while True:
                self._sweep()
                if all(c.finished or c.lost for c in self.contributions.values()):
                    return self._average()
                self._cond.wait(timeout=poll)

    def report(self, peers: list[str]) -> dict[str, dict]:
        """Per-provider contribution, by provider id."""
        with self._cond:
            self._sweep()
            return {peers[i]: {"samples": c.samples, "updates": c.updates,
                               "status": "lost" if c.lost else ("finished" if c.finished else "running")}
                    for i, c in sorted(self.contributions.items())}
