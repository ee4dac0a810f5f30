"""A requester's view of its task as it polls the providers: it tells the bootstrap (whose
dashboard shows it) and, with ``--tensorboard``, writes each provider's curves."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import NetworkError, RemoteError
from meshlearn.network.protocol.bootstrapapi import PROGRESS_STATES
from meshlearn.network.protocol.providerapi import RunStatus
from meshlearn.network.task.spec import Peer
from meshlearn.tblog import MEAN, ScalarLog

log = logging.getLogger(__name__)
REPORT_EVERY = 0.5  # seconds between reports to the bootstrap at most (the last one always goes)
FIELDS = ("state", "iteration", "iterations", "train_loss", "test_acc", "evaluated_at", "leader")


MAX_COUNT = (1 << 31) - 1  # the largest iteration a report may name (``bootstrapapi.ProviderProgress``)


def _finite(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) else None


def _count(value, default):
    """An iteration count from a provider's free-form progress: a whole number a report may carry, else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT else default


class TaskWatch:
    """Progress of one task's providers, faults and result; ``send(body)`` carries a report to
    the bootstrap (``task.progress``), ``scalars`` (optional) receives the curves."""

    def __init__(self, send: Callable[[dict], None], scalars: ScalarLog | None = None, clock: Clock = SYSTEM):
        self.send = send
        self.scalars = scalars
        self.clock = clock
        self.progress: dict[str, dict] = {}
        self._faults: list[str] = []
        self._sent: dict[str, dict] = {}
        self._last_report = float("-inf")
        self._leader: str | None = None
        self._silenced = False

    def fault(self, text: str) -> None:
        """Something went wrong that the page should show (a provider lost, a leader change)."""
        self._faults.append(text[:256])

    def update(self, states: list[tuple[Peer, RunStatus]]) -> None:
        """The providers' latest ``task.status`` answers: (provider, status) pairs."""
        for peer, status in states:
            raw = status.progress
            now = {"state": status.state if status.state in PROGRESS_STATES else "training",
                   "iteration": _count(raw.get("iteration"), 0), "iterations": _count(raw.get("iterations"), 0),
                   "train_loss": _finite(raw.get("train_loss")), "test_acc": _finite(raw.get("test_acc")),
                   "evaluated_at": _count(raw.get("evaluated_at"), None), "leader": status.leader}
            self._curves(peer.id, self.progress.get(peer.id, {}), now)
            self.progress[peer.id] = now
        leaders = [p["leader"] for p in self.progress.values() if p["leader"] and p["state"] == "training"]
        if leaders:
            leader = max(set(leaders), key=leaders.count)
            if self._leader is not None and leader != self._leader:
                self.fault(f"leader changed from {self._leader} to {leader}")
            self._leader = leader
        self._report(final=False)

    def lost(self, provider: str) -> None:
        """A provider stopped answering."""
        if provider in self.progress:
            self.progress[provider]["state"] = "lost"
        self.fault(f"provider {provider} stopped answering")

    def _curves(self, provider: str, before: dict, now: dict) -> None:
        if self.scalars is None:
            return
        name = f"provider_{provider}"
        if now["iteration"] > before.get("iteration", 0):
            self.scalars.add(name, "train/loss", now["train_loss"], now["iteration"])
        if now["evaluated_at"] is not None and now["evaluated_at"] != before.get("evaluated_at"):
            self.scalars.add(name, "test/accuracy", now["test_acc"], now["evaluated_at"])

    def finish(self, metrics: dict | None) -> None:
        """The task ended (``metrics``: its result, None if it failed): a last report, the files closed."""
        result = None
        if metrics is not None:
            result = {"accuracy": _finite(metrics.get("accuracy"))}
            if metrics.get("perplexity") is not None:  # a language model's
                result["perplexity"] = _finite(metrics.get("perplexity"))
            if self.scalars is not None:
                step = max((p["iterations"] for p in self.progress.values()), default=0)
                for key in ("accuracy", "loss", "f1", "perplexity"):
                    self.scalars.add(MEAN, f"result/{key}", _finite(metrics.get(key)), step)
        self._report(final=True, result=result)
        if self.scalars is not None:
            self.scalars.close()

    def _report(self, final: bool, result: dict | None = None) -> None:
        if self._silenced:
            return
        changed = {p: s for p, s in self.progress.items() if self._sent.get(p) != s}
        if not (changed or self._faults or result or final):
            return
        if not final and self.clock.monotonic() - self._last_report < REPORT_EVERY:
            return
        body = {"providers": changed, "faults": self._faults[:32]}
        if result is not None:
            body["result"] = result
        try:
            self.send(body)
        except RemoteError as exc:  # a bootstrap that does not take reports: the task goes on without
            log.info("the bootstrap takes no progress reports (%s)", exc)
            self._silenced = True
            return
        except NetworkError as exc:
            log.debug("progress report not delivered: %s", exc)
            return
        self._last_report = self.clock.monotonic()
        self._sent.update({p: dict(s) for p, s in changed.items()})
        del self._faults[:32]
