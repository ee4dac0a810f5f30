"""The end of a task on one provider, whatever the algorithm: one result for the requester.

Final models go to the task's leader, the lowest-indexed provider alive (an ``Election`` whose
pings are RPC calls, made outside any lock), which aggregates them (sample-weighted mean, over
the providers not lost), evaluates the result, copies it to every other provider and keeps it.
While training, every provider pings the leader every quarter of the peer timeout, so the leader
knows who lives and a follower learns of a dead leader early. A follower whose leader dies pushes
its final model to the next one; one whose leader already holds the result fetches it from there.

A provider that missed a ping is only suspected (a busy machine answers late): the watch pings one
suspected provider below the leader each period, a provider that does not lead answers a final
push, and every ping, with the leader it follows, and a follower pings a suspected provider named
so at once. One that answers is followed again; a provider that led meanwhile steps down (its book
is dropped, and its final model goes to the one taken back). A provider shut out of the task
(``exclude``, a revoked key) is never followed again.

RPC handlers (``on_push``, ``on_ping``, ``on_results``) never block: a final push is recorded
and answered at once, and only the leader's own run thread waits for the others.
"""

from __future__ import annotations

import json
import logging
import math
import threading

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from meshlearn.definitions.leaderstate import LeaderState
from meshlearn.errors import (
    BadMessage,
    KeyMismatch,
    KeyRefused,
    NetworkError,
    RemoteError,
    TaskFailed,
    Unreachable,
)
from meshlearn.network.channel.envelope import Envelope, field_of
from meshlearn.network.channel.rpc import call
from meshlearn.network.task.results import write_results
from meshlearn.network.task.spec import TaskSpec
from meshlearn.node import Node, evaluate_model
from meshlearn.node.algorithms.election import Election
from meshlearn.wire import Kind, Message, decode, encode

log = logging.getLogger(__name__)

COPY_TIMEOUT = 10.0
RETRY = 0.5


class Finisher:
    """One provider's side of the task's end (see the module docstring)."""

    def __init__(self, spec: TaskSpec, context, index: int):
        self.spec = spec
        self.ctx = context  # the ProviderContext: id, secret, folders, clock
        self.index = index
        self.ids = [p.id for p in spec.peers]
        self.election = Election(range(len(self.ids)), index, self._alive, on_dead=self._on_dead,
                                 on_alive=self._on_alive)
        self.results_ready = threading.Event()
        self.book: LeaderState | None = None  # the leader's record of final models
        self.node: Node | None = None
        self.samples = 0
        self.loss: float | None = None  # that of the local steps that made this provider's final model
        self.started_at = 0.0
        self.excluded: set[int] = set()  # providers shut out of the task (revoked keys): never followed
        self.refused_by: str | None = None  # a provider that refused this one's key: it was revoked
        self._final_sent_to: int | None = None
        self._lock = threading.Lock()

    def exclude(self, index: int) -> bool:
        """Leave provider ``index`` out for good (its key was revoked); whether that is news."""
        with self._lock:
            if index in self.excluded or index == self.index:
                return False
            self.excluded.add(index)
        self.election.exclude(index)
        self.election.poke()
        return True

    def add(self, spec: TaskSpec) -> None:
        """The task's providers with one that joined while it trains (the last of ``spec.peers``):
        it gives its final model too, and may lead once every provider before it is gone."""
        with self._lock:
            self.spec = spec
            self.ids = [p.id for p in spec.peers]
        self.election.add(len(self.ids) - 1)

    def check_admitted(self) -> None:
        """Raise TaskFailed once another provider refused this one's key: this provider was
        revoked, and leaves the task to the others (it must not lead them, nor be followed)."""
        if self.refused_by is not None:
            raise TaskFailed(f"provider {self.refused_by} refuses this provider's key (it was revoked): the task "
                             "goes on without it")

    def _note_refusal(self, index: int) -> None:
        self.refused_by = self.ids[index]
        log.warning("task %s: provider %s refuses this provider's key (revoked)", self.spec.task_id, self.ids[index])

    def attach(self, node: Node, samples: int) -> None:
        """The node whose final model this provider gives (once it is built)."""
        self.node, self.samples = node, samples

    # --- this provider's run thread ---------------------------------------------------------

    def finish(self, updates: int, check_cancelled, loss: float | None = None) -> None:
        """Give the final model (``loss``: that of the local steps that made it), and end holding
        the task's result (leader or not)."""
        self.loss = loss if loss is None or math.isfinite(loss) else 1e30
        while not self.results_ready.is_set():
            check_cancelled()
            self.check_admitted()
            leader = self.election.resolve()
            if leader == self.index:
                if self._lead(updates, check_cancelled):
                    return
                continue  # a provider before this one answers again: it leads
            self._step_down()
            if self._final_sent_to != leader:
                try:
                    if not self._push_final(leader, updates):  # it does not lead: ask again shortly
                        self.ctx.clock.sleep(RETRY)
                        continue
                except KeyRefused:  # not a dead leader: this provider is shut out
                    self._note_refusal(leader)
                    continue
                except (Unreachable, KeyMismatch):  # a relayed leader that is gone fails its handshake
                    self.election.mark_dead(leader)
                    continue
                except RemoteError as exc:  # not leading (yet), or not ready: ask again shortly
                    log.info("task %s: final model not taken by %s: %s", self.spec.task_id, self.ids[leader], exc)
                    self.ctx.clock.sleep(RETRY)
                    continue
            self._await_result(leader, check_cancelled)

    def _push_final(self, leader: int, updates: int) -> bool:
        """Give ``leader`` this provider's final model; False if it does not lead (the provider it
        follows instead, if this one suspected it, is pinged: followed again if it answers)."""
        flat = self.node.flat
        blobs = encode(Message(Kind.MODEL, self.index, 1, 0, flat.segments_of(self._final_model().cpu())))
        reply = call(self._address(leader), "agg.push",
                     {"task": self.spec.task_id, "index": self.index, "samples": self.samples, "updates": updates,
                      "loss": self.loss},
                     self.ctx.secret, blobs=blobs, timeout=2 * self.spec.peer_timeout + 5, sender=self.ctx.id,
                     max_bytes=self.ctx.max_message_bytes)
        if reply.body.get("accepted") is False:
            log.info("task %s: final model not taken by %s: it does not lead", self.spec.task_id, self.ids[leader])
            self._follow(reply.body)
            return False
        self._final_sent_to = leader
        if reply.body.get("results"):  # it finished before this model came: its result is the task's
            self._fetch_result(leader)
        return True

    def _await_result(self, leader: int, check_cancelled) -> None:
        """Wait for the leader's result, while it answers and leads; fetch it from there once it
        holds one. Return (to find the leader again) when it is gone, when it follows another (which
        is pinged, if this provider suspected it), or when this provider took back a lower one."""
        while not self.results_ready.wait(RETRY):
            check_cancelled()
            status = self._status_of(leader)
            if status is None:
                self.election.mark_dead(leader)
                return
            if status.get("results"):
                self._fetch_result(leader)
                return
            if self._follow(status) not in (None, leader) or self.election.leader != leader:
                return

    def _follow(self, body: dict) -> int | None:
        """The provider a peer's answer names as the leader it follows (None if it names none), pinged
        if this provider suspected it: a live peer vouches for it, so it is followed again if it answers."""
        named = body.get("leader")
        if isinstance(named, bool) or not isinstance(named, int) or not 0 <= named < len(self.ids):
            return None
        self.election.recheck(named)
        return named

    def _lead(self, updates: int, check_cancelled) -> bool:
        """Lead: wait for every final model (or its provider's loss), then publish the result. False,
        with nothing published, if a provider before this one answers again meanwhile: it leads, this
        one steps down (its book dropped: whoever pushed to it pushes again)."""
        book = self._book()
        if not book.has_final(self.index):
            book.submit(self.index, self._final_model(), self.samples, final=True, updates=updates, loss=self.loss)
        while not book.all_final():
            check_cancelled()
            if self.election.leader != self.index:
                self._step_down()
                return False
            self.ctx.clock.sleep(0.05)
        self._publish(book.aggregate(), book)
        return True

    def _step_down(self) -> None:
        """Drop the book of a provider that no longer leads (one before it answers again): a later turn
        to lead starts a fresh one, not one whose providers all look silent."""
        with self._lock:
            if self.book is not None and self.election.leader != self.index:
                self.book = None

    def _book(self) -> LeaderState:
        with self._lock:
            if self.book is None:
                self.book = LeaderState(list(range(len(self.ids))), self.index, self.spec.peer_timeout,
                                        first_barrier=False, weighting="samples", clock=self.ctx.clock,
                                        rule=self.spec.aggregation)
                for dead in self.election.dead:  # known gone: reported lost, never waited for
                    self.book.mark_lost(dead)
                if self.index != 0:
                    log.warning("task %s: %s takes over as leader", self.spec.task_id, self.ctx.id)
            return self.book

    def _final_model(self) -> torch.Tensor:
        """The final model this provider gives: its own (what a poisoning provider's attack forges,
        in tests)."""
        state = self.node.flat.state.detach()
        if self.ctx.poison:
            return self.node.algorithm.ctx.outgoing(state, self.node.config.iterations)
        return state

    def _suspected(self, book: LeaderState) -> list[str]:
        """The providers this leader suspects: models refused or deviant in training and at the end."""
        ranks = set(book.watch.suspects()) | set(self.node.peers_report()["suspected"])
        return sorted(self.ids[i] for i in ranks if 0 <= i < len(self.ids))

    def _publish(self, average: torch.Tensor, book: LeaderState) -> None:
        """Evaluate the final average, copy the result to every living provider, then keep it."""
        node, spec = self.node, self.spec
        node.flat.state.copy_(average)
        evaluation = evaluate_model(node.model, node.dataset, node.device, spec.eval_samples, full=True)
        contributions = book.report(self.ids)
        dead = self.election.dead
        metrics = {
            "task": spec.task_id, "algorithm": spec.algorithm, "model": spec.model, "epochs": spec.epochs,
            "batch_size": spec.batch_size, "lr": spec.lr, "test_samples": spec.eval_samples or len(node.dataset.test_y),
            **{name: value for name, value in evaluation.as_dict().items() if name != "shown"},
            "class_names": list(node.dataset.class_names),
            "training_time": self.ctx.clock.monotonic() - self.started_at,
            "leader": self.ctx.id, "leaders_lost": [self.ids[i] for i in sorted(dead) if i < self.index],
            "providers": contributions,
            "lost": sorted(pid for pid, c in contributions.items() if c["status"] == "lost"),
            "aggregation": spec.aggregation,
            # under a rule that is not robust one bad model spreads: the peers refused are no attribution
            "suspected" if book.rule.robust else "refused_from": self._suspected(book),
            **node.algorithm.task_report(),  # a synchronous leader's models per cycle
            **self._privacy(contributions),
        }
        model_bytes = save_safetensors({k: v.detach().cpu().contiguous() for k, v in node.model.state_dict().items()})
        for i in range(len(self.ids)):  # copies first: a provider told "done" then has its copy
            if i != self.index and i not in dead and contributions.get(self.ids[i], {}).get("status") != "lost":
                try:
                    call(self._address(i), "agg.results", {"task": spec.task_id, "metrics": metrics},
                         self.ctx.secret, blobs=[model_bytes], timeout=COPY_TIMEOUT, sender=self.ctx.id,
                         max_bytes=self.ctx.max_message_bytes)
                except KeyRefused:  # this leader was revoked: its result is not the task's
                    self._note_refusal(i)
                    self.check_admitted()
                except NetworkError as exc:  # gone, refusing, or its connection dropped mid-handshake
                    log.warning("task %s: result not copied to %s: %s", spec.task_id, self.ids[i], exc)
        self._keep(metrics, model_bytes)

    def _privacy(self, contributions: dict[str, dict]) -> dict:
        """What the privacy mechanisms say of the task (DP-SGD: the epsilon each provider spent, from its
        shard's size and the steps of the run, as a simulation's summary says it; central DP's)."""
        return self.node.privacy.group_report([c.get("samples") for c in contributions.values()])

    def _fetch_result(self, leader: int) -> None:
        reply = call(self._address(leader), "task.results", {"task": self.spec.task_id}, self.ctx.secret,
                     timeout=30, sender=self.ctx.id, max_bytes=self.ctx.max_message_bytes)
        self._take_result(reply)

    def _keep(self, metrics: dict, model_bytes: bytes) -> None:
        write_results(self.ctx.workdir / "tasks" / self.spec.task_id / "result", metrics, model_bytes, plot=False,
                      task={"task": self.spec.settings()})
        self.results_ready.set()

    # --- other providers' calls ---------------------------------------------------------------

    def on_push(self, req: Envelope) -> dict:
        """A follower's final model: recorded if this provider leads (it never waits here)."""
        index = field_of(req.body, "index", int, min_value=0)
        if index >= len(self.ids) or index == self.index or index in self.excluded:
            raise BadMessage(f"provider index {index} is not another provider of this task")
        if self.results_ready.is_set():
            return {"results": True}
        if self.node is None:
            raise BadMessage(f"{self.ctx.id} is not ready for models yet")
        leader = self.election.leader
        if leader != self.index:
            self.election.poke()  # perhaps the leader this provider knows is gone
            return {"accepted": False, "leader": leader}  # (the pusher pings it if it suspected it)
        msg = decode(req.blobs, self.ctx.max_message_bytes)
        problem = self.node.flat.check_compatible(msg.tensors)
        if problem:
            raise BadMessage(f"model does not fit this task: {problem}")
        vector = torch.cat([msg.tensors[name] for name in self.node.flat.ranges])
        loss = field_of(req.body, "loss", (int, float, type(None)), None)
        self._book().submit(index, vector, field_of(req.body, "samples", int, min_value=0), final=True, copy=False,
                            updates=field_of(req.body, "updates", int, 0, min_value=0),
                            loss=None if loss is None or isinstance(loss, bool) else float(loss))
        return {"accepted": True}

    def on_ping(self, req: Envelope) -> dict:
        """A sign of life from provider ``index``; the answer says whether this one holds the result,
        and which provider it follows as leader."""
        index = field_of(req.body, "index", int, min_value=0)
        book = self.book
        if book is not None and index < len(self.ids):
            book.touch(index)
        return {"results": self.results_ready.is_set(), "leader": self.election.leader}

    def release(self) -> None:
        """Drop the model and the leader's book once the run has ended: what peers and the
        requester still ask for (the result) is on disk."""
        self.node = None
        self.book = None

    def on_results(self, req: Envelope) -> dict:
        """A copy of the final result from the leader: checked against this task's model, then kept."""
        if self.results_ready.is_set():
            return {"kept": True}
        if self.node is None:
            raise BadMessage(f"{self.ctx.id} cannot check a result for task {self.spec.task_id}: its run is not on")
        self._take_result(req)
        return {"kept": True}

    def _take_result(self, reply: Envelope) -> None:
        metrics = field_of(reply.body, "metrics", dict, max_len=1_000_000)
        if len(reply.blobs) != 1:
            raise BadMessage("a result carries exactly one model")
        try:
            tensors = load_safetensors(bytes(reply.blobs[0]))
        except Exception:
            raise BadMessage("the result's model is not a valid safetensors file") from None
        mine = self.node.model.state_dict() if self.node is not None else {}
        if mine and ({k: tuple(v.shape) for k, v in tensors.items()} != {k: tuple(v.shape) for k, v in mine.items()}):
            raise BadMessage("the result's model does not match this task's model")
        self._keep(json.loads(json.dumps(metrics)), bytes(reply.blobs[0]))

    # --- liveness -------------------------------------------------------------------------------

    def _address(self, index: int) -> str:
        return self.spec.peers[index].address

    def _status_of(self, index: int) -> dict | None:
        """A provider's answer to a ping: None if it is gone or out of the task; {} if it refuses
        this provider's key (it lives: this one was revoked, see ``check_admitted``)."""
        if index in self.excluded:
            return None
        try:
            return call(self._address(index), "agg.ping", {"task": self.spec.task_id, "index": self.index},
                        self.ctx.secret, timeout=min(3.0, self.spec.peer_timeout / 2), sender=self.ctx.id).body
        except KeyRefused:
            self._note_refusal(index)
            return {}
        except NetworkError:  # gone, refusing, or its connection dropped mid-handshake
            return None

    def _alive(self, index: int) -> bool:
        return self._status_of(index) is not None

    def _on_dead(self, index: int) -> None:
        log.warning("task %s: provider %s is gone", self.spec.task_id, self.ids[index])
        book = self.book
        if book is not None:
            book.mark_lost(index)

    def _on_alive(self, index: int) -> None:
        log.warning("task %s: provider %s answers again: it was only slow", self.spec.task_id, self.ids[index])
