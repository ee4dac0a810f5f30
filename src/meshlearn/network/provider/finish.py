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

Who the task's providers are is the ``Roster``'s (``roster.py``); the result, published or
copied, the ``TaskResult``'s (``taskresult.py``).
"""

from __future__ import annotations

import logging
import math
import threading

import torch

from meshlearn.definitions.leaderstate import LeaderState
from meshlearn.errors import (
    BadMessage,
    KeyMismatch,
    KeyRefused,
    NetworkError,
    RemoteError,
    Unreachable,
)
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.protocol.providerapi import (
    Kept,
    Pong,
    Provider,
    Push,
    PushAnswer,
    ResultCopy,
)
from meshlearn.network.protocol.rpcs import AGG_PING, AGG_PUSH
from meshlearn.network.protocol.serving import ask
from meshlearn.network.provider.roster import Roster
from meshlearn.network.provider.taskresult import TaskResult
from meshlearn.network.task.spec import TaskSpec
from meshlearn.node import Node
from meshlearn.node.algorithms.election import Election
from meshlearn.wire import Kind, Message, decode, encode

log = logging.getLogger(__name__)

RETRY = 0.5  # seconds between a follower's attempts to give its final model or get the result


class Finisher:
    """One provider's side of the task's end (see the module docstring)."""

    def __init__(self, spec: TaskSpec, context, index: int):
        self.ctx = context  # the ProviderContext: id, secret, folders, clock
        self.index = index
        self.roster = Roster(spec, index)
        self.result = TaskResult(self.roster, context)
        self.election = Election(range(len(self.ids)), index, self._alive, on_dead=self._on_dead,
                                 on_alive=self._on_alive)
        self.book: LeaderState | None = None  # the leader's record of final models
        self.node: Node | None = None
        self.samples = 0
        self.loss: float | None = None  # that of the local steps that made this provider's final model
        self.started_at = 0.0
        self._final_sent_to: int | None = None
        self._lock = threading.Lock()

    @property
    def spec(self) -> TaskSpec:
        """The task as this provider knows it (with the providers that joined while it trains)."""
        return self.roster.spec

    @property
    def ids(self) -> list[str]:
        """The task's providers' ids, by index."""
        return self.roster.ids

    @property
    def excluded(self) -> set[int]:
        """Providers shut out of the task (revoked keys): never followed."""
        return self.roster.excluded

    def exclude(self, index: int) -> bool:
        """Leave provider ``index`` out for good (its key was revoked); whether that is news."""
        if not self.roster.exclude(index):
            return False
        self.election.exclude(index)
        self.election.poke()
        return True

    def add(self, spec: TaskSpec) -> None:
        """The task's providers with one that joined while it trains (the last of ``spec.peers``):
        it gives its final model too, and may lead once every provider before it is gone."""
        self.roster.add(spec)
        self.election.add(len(self.ids) - 1)

    def check_admitted(self) -> None:
        """Raise TaskFailed once another provider refused this one's key (``Roster.check_admitted``)."""
        self.roster.check_admitted()

    def attach(self, node: Node, samples: int) -> None:
        """The node whose final model this provider gives (once it is built)."""
        self.node, self.samples = node, samples

    # --- this provider's run thread ---------------------------------------------------------

    def finish(self, updates: int, check_cancelled, loss: float | None = None) -> None:
        """Give the final model (``loss``: that of the local steps that made it), and end holding
        the task's result (leader or not)."""
        self.loss = loss if loss is None or math.isfinite(loss) else 1e30
        while not self.result.ready.is_set():
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
                    self.roster.note_refusal(leader)
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
        push = Push(task=self.spec.task_id, index=self.index, samples=self.samples, updates=updates, loss=self.loss)
        reply: PushAnswer = ask(self.roster.address(leader), AGG_PUSH, push, self.ctx.secret, blobs=blobs,
                                timeout=2 * self.spec.peer_timeout + 5, sender=self.ctx.id,
                                max_bytes=self.ctx.max_message_bytes)
        if reply.accepted is False:
            log.info("task %s: final model not taken by %s: it does not lead", self.spec.task_id, self.ids[leader])
            self._follow(reply.leader)
            return False
        self._final_sent_to = leader
        if reply.results:  # it finished before this model came: its result is the task's
            self.result.fetch(leader, self.node)
        return True

    def _await_result(self, leader: int, check_cancelled) -> None:
        """Wait for the leader's result, while it answers and leads; fetch it from there once it
        holds one. Return (to find the leader again) when it is gone, when it follows another (which
        is pinged, if this provider suspected it), or when this provider took back a lower one."""
        while not self.result.ready.wait(RETRY):
            check_cancelled()
            try:
                status = self._ping(leader)
            except KeyRefused:  # it lives, and refuses this provider's key: this one was revoked (check_admitted)
                self.roster.note_refusal(leader)
                status = None
            except NetworkError:  # gone, out of the task, or its connection dropped mid-handshake
                self.election.mark_dead(leader)
                return
            if status is not None and status.results:
                self.result.fetch(leader, self.node)
                return
            named = self._follow(status.leader) if status is not None else None
            if named not in (None, leader) or self.election.leader != leader:
                return

    def _follow(self, named: int | None) -> int | None:
        """The provider a peer's answer names as the leader it follows (None if it names none of this
        task's), pinged if this provider suspected it: a live peer vouches for it, so it is followed
        again if it answers."""
        if named is None or not 0 <= named < len(self.ids):
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
        self.result.publish(self.node, book, book.aggregate(), self.election, self.started_at)
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
        if self.ctx.hooks.model_poison:
            return self.node.algorithm.ctx.outgoing(state, self.node.config.iterations)
        return state

    # --- other providers' calls ---------------------------------------------------------------

    def on_push(self, message: Push, req: Envelope) -> PushAnswer:
        """A follower's final model (``req``'s blobs): recorded if this provider leads (it never waits here)."""
        index = message.index
        if index >= len(self.ids) or index == self.index or index in self.excluded:
            raise BadMessage(f"provider index {index} is not another provider of this task")
        if self.result.ready.is_set():
            return PushAnswer(results=True)
        if self.node is None:
            raise BadMessage(f"{self.ctx.id} is not ready for models yet")
        leader = self.election.leader
        if leader != self.index:
            self.election.poke()  # perhaps the leader this provider knows is gone
            return PushAnswer(accepted=False, leader=leader)  # (the pusher pings it if it suspected it)
        msg = decode(req.blobs, self.ctx.max_message_bytes)
        problem = self.node.flat.check_compatible(msg.tensors)
        if problem:
            raise BadMessage(f"model does not fit this task: {problem}")
        vector = torch.cat([msg.tensors[name] for name in self.node.flat.ranges])
        self._book().submit(index, vector, message.samples, final=True, copy=False, updates=message.updates,
                            loss=message.loss)
        return PushAnswer(accepted=True)

    def on_ping(self, message: Provider, req: Envelope) -> Pong:
        """A sign of life from provider ``index``; the answer says whether this one holds the result,
        and which provider it follows as leader."""
        book = self.book
        if book is not None and message.index < len(self.ids):
            book.touch(message.index)
        return Pong(results=self.result.ready.is_set(), leader=self.election.leader)

    def release(self) -> None:
        """Drop the model and the leader's book once the run has ended: what peers and the
        requester still ask for (the result) is on disk."""
        self.node = None
        self.book = None

    def on_results(self, message: ResultCopy, req: Envelope) -> Kept:
        """A copy of the final result from the leader (its model ``req``'s one blob): checked against
        this task's model, then kept."""
        if self.result.ready.is_set():
            return Kept(kept=True)
        node = self.node
        if node is None:
            raise BadMessage(f"{self.ctx.id} cannot check a result for task {self.spec.task_id}: its run is not on")
        self.result.take(message.metrics, bytes(req.blobs[0]), node)
        return Kept(kept=True)

    # --- liveness -------------------------------------------------------------------------------

    def _ping(self, index: int) -> Pong:
        """Provider ``index``'s answer to a ping; NetworkError if it is gone or out of the task
        (KeyRefused if it refuses this provider's key: it lives, this one was revoked)."""
        if index in self.excluded:
            raise NetworkError(f"provider {self.ids[index]} is out of task {self.spec.task_id}")
        return ask(self.roster.address(index), AGG_PING, Provider(task=self.spec.task_id, index=self.index),
                   self.ctx.secret, timeout=min(3.0, self.spec.peer_timeout / 2), sender=self.ctx.id)

    def _alive(self, index: int) -> bool:
        """Whether provider ``index`` answers a ping (one that refuses this provider's key lives)."""
        try:
            self._ping(index)
        except KeyRefused:
            self.roster.note_refusal(index)
        except NetworkError:  # gone, out of the task, or its connection dropped mid-handshake
            return False
        return True

    def _on_dead(self, index: int) -> None:
        log.warning("task %s: provider %s is gone", self.spec.task_id, self.ids[index])
        book = self.book
        if book is not None:
            book.mark_lost(index)

    def _on_alive(self, index: int) -> None:
        log.warning("task %s: provider %s answers again: it was only slow", self.spec.task_id, self.ids[index])
