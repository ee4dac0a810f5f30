"""A run's log events as TensorBoard scalars, written while the run goes on (``--tensorboard DIR``).

Per node (``node_K``, for runs of at most ``tblog.PER_NODE_LIMIT`` nodes), at step = iterations
done: ``train/loss``, ``time/<phase>`` and ``time/iteration`` (seconds), ``traffic/bytes_sent``,
``link/missing`` and ``link/chunks_missing``; at each evaluation ``test/accuracy`` and
``test/loss`` (and a language model's ``test/perplexity``). The ``mean`` writer holds summary.csv's
rows, each written once every honest evaluating node has reported it (the rest when the run ends):
``test/accuracy`` and ``test/accuracy_std``, ``test/loss`` and ``test/loss_std`` (a language
model's ``test/perplexity`` and ``test/perplexity_std``), ``time/elapsed`` and
``time/elapsed_std``, ``consensus/distance`` and ``average_model/accuracy``, ``/loss`` (a language
model's ``/perplexity``: the honest nodes' average model, batched engine), ``bad_nodes/accuracy``,
``traffic/mb_sent`` (MB sent per node by then); and per
iteration, once every node has done it, the mean ``train/loss`` and ``time/<phase>``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from meshlearn.config import ExperimentConfig
from meshlearn.sim.tables import PHASES, evaluation_row
from meshlearn.tblog import MEAN, ScalarLog

# summary.csv's column -> the mean writer's tag
ROW_TAGS = {"test_acc_mean": "test/accuracy", "test_acc_std": "test/accuracy_std", "test_loss_mean": "test/loss",
            "test_loss_std": "test/loss_std", "time_mean": "time/elapsed", "time_std": "time/elapsed_std",
            "consensus_distance": "consensus/distance", "attackers_acc_mean": "bad_nodes/accuracy",
            "mb_sent_mean": "traffic/mb_sent", "test_perplexity_mean": "test/perplexity",
            "test_perplexity_std": "test/perplexity_std", "average_acc": "average_model/accuracy",
            "average_loss": "average_model/loss", "average_perplexity": "average_model/perplexity"}
NODE_TAGS = {"train_loss": "train/loss", "bytes_sent": "traffic/bytes_sent", "missing": "link/missing",
             "chunks_missing": "link/chunks_missing", **{p: f"time/{p}" for p in PHASES}}


class TensorBoardSink:
    """Writes one run's events into ``folder`` (a ``RunWatch`` sink)."""

    def __init__(self, config: ExperimentConfig, folder: str | Path):
        self.log = ScalarLog(folder, config.nodes)
        self.nodes = config.nodes
        self.attackers = set(config.attackers())
        evaluating = [r for r in range(config.nodes) if config.node_evaluates(r)]
        self.honest_evaluating = sum(1 for r in evaluating if r not in self.attackers)
        self.bad_evaluating = len(evaluating) - self.honest_evaluating
        self._evals: dict[int, list[dict]] = defaultdict(list)
        self._bad_evals: dict[int, list[dict]] = defaultdict(list)
        self._steps: dict[int, list[dict]] = defaultdict(list)

    def add(self, events: list[dict[str, Any]]) -> None:
        for event in events:
            kind, rank = event.get("event"), event.get("rank")
            if not isinstance(rank, int):
                continue
            if kind == "iteration":
                self._iteration(rank, event)
            elif kind == "eval":
                self._evaluation(rank, event)

    def _iteration(self, rank: int, event: dict) -> None:
        step = int(event["iteration"]) + 1
        name = f"node_{rank}"
        for field, tag in NODE_TAGS.items():
            self.log.add(name, tag, event.get(field), step)
        self.log.add(name, "time/iteration", sum(event.get(p) or 0.0 for p in PHASES), step)
        group = self._steps[step]
        group.append(event)
        if len(group) == self.nodes:
            self._write_step(step, self._steps.pop(step))

    def _write_step(self, step: int, group: list[dict]) -> None:
        honest = [e for e in group if e["rank"] not in self.attackers]
        losses = [e["train_loss"] for e in honest if e.get("train_loss") is not None]
        if losses:
            self.log.add(MEAN, "train/loss", statistics.fmean(losses), step)
        for phase in PHASES:
            self.log.add(MEAN, f"time/{phase}", statistics.fmean(e.get(phase) or 0.0 for e in group), step)

    def _evaluation(self, rank: int, event: dict) -> None:
        step = int(event["iteration"])
        name = f"node_{rank}"
        self.log.add(name, "test/accuracy", event.get("test_acc"), step)
        self.log.add(name, "test/loss", event.get("test_loss"), step)
        self.log.add(name, "test/perplexity", event.get("test_perplexity"), step)
        (self._bad_evals if rank in self.attackers else self._evals)[step].append(event)
        if len(self._evals[step]) == self.honest_evaluating and len(self._bad_evals[step]) == self.bad_evaluating:
            self._write_row(step)

    def _write_row(self, step: int) -> None:
        group, bad = self._evals.pop(step), self._bad_evals.pop(step, [])
        row = evaluation_row(step, group, bad if self.attackers else None)
        for column, tag in ROW_TAGS.items():
            self.log.add(MEAN, tag, row.get(column), step)

    def close(self) -> None:
        """The run ended: write the rows and steps not every node reported, and flush."""
        for step in sorted(self._evals):
            self._write_row(step)
        for step in sorted(self._steps):
            self._write_step(step, self._steps.pop(step))
        self.log.close()
