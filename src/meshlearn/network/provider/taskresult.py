"""A task's result on one of its providers, at the task's end (``finish.Finisher``): the leader
makes it and copies it to the others; a follower takes the copy, or fetches it from the leader."""

from __future__ import annotations

import json
import logging
import threading

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from meshlearn.definitions.leaderstate import LeaderState
from meshlearn.errors import BadMessage, KeyRefused, NetworkError
from meshlearn.network.protocol.bootstrapapi import TaskName
from meshlearn.network.protocol.providerapi import ResultCopy
from meshlearn.network.protocol.rpcs import AGG_RESULTS, TASK_RESULTS
from meshlearn.network.protocol.serving import ask, ask_with_blobs
from meshlearn.network.provider.roster import Roster
from meshlearn.network.task.results import write_results
from meshlearn.node import Node, evaluate_model
from meshlearn.node.algorithms.election import Election

log = logging.getLogger(__name__)

COPY_TIMEOUT = 10.0  # seconds the leader waits for each provider to take its copy of the result
FETCH_TIMEOUT = 30.0  # seconds a follower waits for the leader's result it fetches


class TaskResult:
    """The result this provider holds (``ready`` once it is kept, on disk under the task's
    folder): the one it published as the leader (``publish``), or a copy of the leader's, pushed
    (``take``) or fetched (``fetch``), checked against the task's model. ``ctx``: the
    ProviderContext (id, secret, folders, clock)."""

    def __init__(self, roster: Roster, context):
        self.roster = roster
        self.ctx = context
        self.ready = threading.Event()

    def publish(self, node: Node, book: LeaderState, average: torch.Tensor, election: Election,
                started_at: float) -> None:
        """Evaluate the final average, copy the result to every living provider (those ``election``
        has not given up), then keep it (``started_at``: when training started, on the clock's
        monotonic time)."""
        spec, ids = self.roster.spec, self.roster.ids
        node.flat.state.copy_(average)
        evaluation = evaluate_model(node.model, node.dataset, node.device, spec.eval_samples, full=True)
        contributions = book.report(ids)
        dead = election.dead
        metrics = {
            "task": spec.task_id, "algorithm": spec.algorithm, "model": spec.model, "epochs": spec.epochs,
            "batch_size": spec.batch_size, "lr": spec.lr, "test_samples": spec.eval_samples or len(node.dataset.test_y),
            **{name: value for name, value in evaluation.as_dict().items() if name != "shown"},
            "class_names": list(node.dataset.class_names),
            "training_time": self.ctx.clock.monotonic() - started_at,
            "leader": self.ctx.id, "leaders_lost": [ids[i] for i in sorted(dead) if i < self.roster.index],
            "providers": contributions,
            "lost": sorted(pid for pid, c in contributions.items() if c["status"] == "lost"),
            "aggregation": spec.aggregation,
            # under a rule that is not robust one bad model spreads: the peers refused are no attribution
            "suspected" if book.rule.robust else "refused_from": _suspected(node, book, ids),
            **node.algorithm.task_report(),  # a synchronous leader's models per cycle
            **_privacy(node, contributions),
        }
        model_bytes = save_safetensors({k: v.detach().cpu().contiguous() for k, v in node.model.state_dict().items()})
        self._copy_to_others(metrics, model_bytes, contributions, dead)
        self.keep(metrics, model_bytes)

    def _copy_to_others(self, metrics: dict, model_bytes: bytes, contributions: dict[str, dict],
                        dead: frozenset[int]) -> None:
        """The result to every other provider not gone nor lost (copies first: a provider told
        "done" then has its copy)."""
        ids = self.roster.ids
        copy = ResultCopy(task=self.roster.spec.task_id, metrics=metrics)
        for i in range(len(ids)):
            if i != self.roster.index and i not in dead and contributions.get(ids[i], {}).get("status") != "lost":
                try:
                    ask(self.roster.address(i), AGG_RESULTS, copy, self.ctx.secret, blobs=[model_bytes],
                        timeout=COPY_TIMEOUT, sender=self.ctx.id, max_bytes=self.ctx.max_message_bytes)
                except KeyRefused:  # this leader was revoked: its result is not the task's
                    self.roster.note_refusal(i)
                    self.roster.check_admitted()
                except NetworkError as exc:  # gone, refusing, or its connection dropped mid-handshake
                    log.warning("task %s: result not copied to %s: %s", self.roster.spec.task_id, ids[i], exc)

    def fetch(self, leader: int, node: Node | None) -> None:
        """The leader's result, fetched from it, checked against ``node``'s model and kept."""
        reply, blobs = ask_with_blobs(self.roster.address(leader), TASK_RESULTS, TaskName(task=self.roster.spec.task_id),
                                      self.ctx.secret, timeout=FETCH_TIMEOUT, sender=self.ctx.id,
                                      max_bytes=self.ctx.max_message_bytes)
        self.take(reply.metrics, bytes(blobs[0]), node)

    def take(self, metrics: dict, model_bytes: bytes, node: Node | None) -> None:
        """A result (its metrics and its safetensors model) a leader sent or gave, checked against
        ``node``'s model (where there is one) and kept."""
        try:
            tensors = load_safetensors(model_bytes)
        except Exception:  # noqa: BLE001 - any failure means: not a safetensors file
            raise BadMessage("the result's model is not a valid safetensors file") from None
        mine = node.model.state_dict() if node is not None else {}
        if mine and ({k: tuple(v.shape) for k, v in tensors.items()} != {k: tuple(v.shape) for k, v in mine.items()}):
            raise BadMessage("the result's model does not match this task's model")
        self.keep(json.loads(json.dumps(metrics)), model_bytes)

    def keep(self, metrics: dict, model_bytes: bytes) -> None:
        """Write the result under the task's folder; it is ready."""
        write_results(self.ctx.workdir / "tasks" / self.roster.spec.task_id / "result", metrics, model_bytes,
                      plot=False, task={"task": self.roster.spec.settings()})
        self.ready.set()


def _suspected(node: Node, book: LeaderState, ids: list[str]) -> list[str]:
    """The providers a leader suspects: models refused or deviant in training and at the end."""
    ranks = set(book.watch.suspects()) | set(node.peers_report()["suspected"])
    return sorted(ids[i] for i in ranks if 0 <= i < len(ids))


def _privacy(node: Node, contributions: dict[str, dict]) -> dict:
    """What the privacy mechanisms say of the task (DP-SGD: the epsilon each provider spent, from its
    shard's size and the steps of the run, as a simulation's summary says it; central DP's)."""
    return node.privacy.group_report([c.get("samples") for c in contributions.values()])
