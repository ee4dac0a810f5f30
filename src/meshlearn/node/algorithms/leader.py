"""Leader aggregation (CloudMesh's design): every member pushes its model to a leader after its
local steps and trains on from the aggregate the leader answers with at once.

Asynchronous: the leader keeps every member's latest model (``LeaderState``) and answers each
push with the aggregate of those, weighted by samples and staleness. Only the first cycle waits
for everyone (so that all start from one model) and the final push waits for every member's
final model (so that all end with the same one). The leader is the lowest-ranked member alive
(``Election``): a member whose push finds no leader suspects it and pushes to the next, and
that member leads from then on. While training, each member pings the leader every quarter of the
peer timeout, so the leader knows who lives (a member silent for the timeout is lost and left
out) and members notice a dead leader between pushes. A leader suspected wrongly (a ping that
came back late from a busy machine) is taken back: each period a member also pings one member
it suspects below its leader, and a member that does not lead answers a push with the leader it
follows, which the pusher pings at once if it suspected that one. A member that leads meanwhile
steps down as soon as a lower one is taken back: its book is dropped, its own push and the
pushes it holds go to the lower one. The group is this node and every peer it
was connected to (in a simulation every node of the run, whatever the topology); the peer
timeout is the transport's ``wait_timeout``.

A member may join while the group trains (a network task's newcomer): every member takes it in
(``add_member``), then it asks the leader to ``join``: the leader counts it a member from then on
and answers with a model and the cycle it is of (``LeaderState.join``: asynchronous, the aggregate
of the latest models at the slowest member's cycle; synchronous, the aggregate of the newest cycle
every member pushed, the next cycles waiting for the newcomer too), and the newcomer trains on
from that model at the next cycle.

A push carries its cycle (the member's iteration), and the leader takes one push per member and
cycle: a push that did not open on the way is refused at once and sent again (shortly after, and
a little later each time it is refused again), a push whose answer is slow is sent again every
peer timeout while the leader lives (the push or its answer may have been lost), and a copy of a
cycle the leader already has counts once. A ping refused on the way still shows the leader alive.

Synchronous (``LeaderSettings.sync``, the CloudMesh report's code): the leader answers a cycle once
every living member pushed it, all with one aggregate (``LeaderState``); with ``fraction`` below 1
that aggregate takes the models of a seeded share of the members each cycle (``fedavg.participants``):
FedAvg, whose server is the leader and fails over as the leader does. A new leader starts its book
empty: the members push their cycle to it again, and it answers once every living member did.

A member's decisions (its cycle, its push, the seconds it waited, what its model weighs where it
says so itself, when it sends a refused push again) are its ``LeaderMember``, the leader's its book
(``LeaderState``): both engines drive the same two state machines; this runtime carries them over
the hub endpoint, the election's fail-over and secure aggregation.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from meshlearn.definitions.leadermember import LeaderMember
from meshlearn.definitions.leaderstate import LeaderState, Push
from meshlearn.definitions.settings import LeaderSettings
from meshlearn.errors import ConfigError, WireError
from meshlearn.meta import meta_number, meta_real
from meshlearn.node.algorithms.base import Algorithm, AlgorithmContext
from meshlearn.node.algorithms.election import Election
from meshlearn.node.algorithms.secure import (
    OPEN_BYTES,
    SEALED_BYTES,
    SecureAggregationFailed,
    SecureBook,
    SecurePusher,
    StaleCycle,
    pack,
    pack_keys,
    read_push,
    unpack,
    weighted_mean,
)
from meshlearn.privacy.masking import RING_LIMIT
from meshlearn.sparselog import SparseLog
from meshlearn.threads import GuardedThread
from meshlearn.transport.hub import Answer, HubEndpoint
from meshlearn.transport.served import Caller, is_refusal
from meshlearn.wire import Message

log = logging.getLogger(__name__)
RETRY = 0.2  # seconds before asking again a member that says it does not lead (yet)
PING_TIMEOUT = 3.0
LEAD_POLL = 0.01  # seconds between looks at its own book of a leader waiting for its cycle's answer


class Leader(Algorithm):
    """Leader aggregation with fail-over, asynchronous or synchronous (see the module docstring)."""

    name = "leader"
    endpoint = HubEndpoint
    talks_to = "everyone"

    def __init__(self, ctx: AlgorithmContext):
        super().__init__(ctx)
        self.hub: HubEndpoint = ctx.transport
        self.settings = ctx.settings or LeaderSettings()
        self.timeout = self.hub.settings.wait_timeout
        self.election: Election | None = None  # from start(), once the group is known
        self.state: LeaderState | None = None  # while this member leads
        self.member = LeaderMember(ctx.samples, ctx.iterations, settings=self.settings, seed=ctx.seed, rank=ctx.rank)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._callers = threading.local()  # each thread calls through its own sockets
        self._watcher: GuardedThread | None = None
        self._refusals = SparseLog(log)
        self._secure: SecureBook | None = None  # secure aggregation: the leader's side, while leading
        self._pusher: SecurePusher | None = None  # secure aggregation: this member's side
        self._held_ops: dict[int, tuple[str, int]] = {}  # secure: what each held request is (op, cycle)
        self._secure_lock = threading.RLock()  # a push's record and a cycle's close, one at a time
        self.privacy = ctx.privacy  # its hooks: the push (central DP's clipping, secure aggregation's masks), the
        # aggregate (central DP's noise)
        self.hub.serve(self)

    # --- the training thread ------------------------------------------------------------------

    def start(self) -> None:
        members = {self.ctx.rank, *self.hub.peers}
        self.election = Election(members, self.ctx.rank, self._ping, on_dead=self._lost, on_alive=self._taken_back)
        if self.election.leader == self.ctx.rank:
            self._lead(start=True)
        if self.ctx.joining:
            self._join_group()
        self.privacy.begin(self.ctx.flat.state.detach())  # central DP: the first cycle's start
        self._watcher = GuardedThread(self.election.watch, f"leader-watch-{self.ctx.rank}",
                                      (self._stop, max(0.2, self.timeout / 4)))
        self._watcher.start()

    def add_member(self, rank: int, address: str, at: int | None = None) -> None:
        self.hub.add_peer(rank, address)
        if self.election is not None:
            self.election.add(rank)

    def _join_group(self) -> None:
        """A newcomer's start: ask the leader (following fail-over) to count it a member, and take
        the group's current aggregate and cycle (it starts at the next one)."""
        ctx = self.ctx
        while True:
            leader = self.election.leader
            if leader == ctx.rank:
                raise ConfigError("a member joining the group found no other member alive to join")
            reply = self._caller().call(leader, self.timeout, meta={"op": "join", "samples": ctx.samples},
                                        patience=lambda: not self.election.is_dead(leader))
            if reply is None:
                self.election.mark_dead(leader)
                self.election.resolve()
                continue
            cycle = meta_real(reply.meta, "cycle", None)  # -1: the group has made no cycle yet
            if reply.meta.get("status") == "ok" and cycle is not None and cycle.is_integer() and cycle >= -1 \
                    and ctx.flat.check_compatible(reply.tensors) is None:
                ctx.flat.state.copy_(torch.cat([reply.tensors[name] for name in ctx.flat.ranges]))
                self.joined_at = int(cycle) + 1
                return
            time.sleep(RETRY)  # not the leader (yet), or refused on the way: ask again
            self._follow(reply)

    def after_local_steps(self, iteration: int, train_loss: float | None = None) -> dict[str, float]:
        """This member's cycle ``iteration``, as its ``LeaderMember`` decides: its push, then the aggregate
        it trains on from."""
        ctx, member = self.ctx, self.member
        member.trained(train_loss)
        member.pushing(iteration)
        state = ctx.outgoing(ctx.flat.state.detach(), iteration).to("cpu", copy=True)
        self.privacy.before_push(state)  # DP-FedAvg: this member's update over the cycle clipped
        push = member.push(state)
        aggregate = self._secure_exchange(push) if self.privacy.masks else self._exchange(push)
        comm = member.answered()
        t1 = time.perf_counter()
        if aggregate is not None:  # (None: secure aggregation's cycle without weight, each member keeps its model)
            ctx.flat.state.copy_(aggregate)
            self.privacy.after_aggregate(aggregate)  # central DP: the next update counts from it
        return {"comm": comm, "average": time.perf_counter() - t1, "leader": self.election.leader}

    def check(self) -> None:
        super().check()
        if self._watcher is not None:
            self._watcher.raise_if_failed()

    def exclude(self, rank: int) -> None:
        """Also never follow ``rank`` as leader, nor count its model, whatever it answers (unlike a
        member only suspected): the watcher finds the next leader at once if it was this one."""
        super().exclude(rank)
        if self.election is not None:
            self.election.exclude(rank)
            self.election.poke()

    def stop(self) -> None:
        self._stop.set()
        if self.election is not None:
            self.election.poke()
        if self._watcher is not None:
            self._watcher.join(timeout=PING_TIMEOUT + 2)

    def _exchange(self, push: Push) -> torch.Tensor:
        """Give the leader this member's ``push`` and take its aggregate back, following
        fail-over, and sending the push again when it is refused on the way."""
        ctx = self.ctx
        while True:
            leader = self.election.leader
            if leader == ctx.rank:
                aggregate = self._lead_cycle(push)
                if aggregate is not None:
                    return aggregate
                continue  # a lower member was taken back: it leads, and gets the push
            self._step_down()
            reply = self._caller().call(leader, self.timeout, ctx.flat.segments_of(push.state),
                                        {"op": "push", **LeaderMember.fields(push)},
                                        patience=lambda: not self.election.is_dead(leader) and not self._stop.is_set())
            if reply is None:  # no answer: the leader is gone
                self.election.mark_dead(leader)
                self.election.resolve()
            elif reply.meta.get("status") == "ok" and ctx.flat.check_compatible(reply.tensors) is None:
                return torch.cat([reply.tensors[name] for name in ctx.flat.ranges])
            elif is_refusal(reply):  # damaged on the way: the same leader, again
                self._refusals.warning("push", "node %d: the push of cycle %d to %d was refused on the way, sent "
                                       "again: %s", ctx.rank, push.cycle, leader, reply.meta.get("reason"))
                time.sleep(self.member.refused())
            else:  # it does not lead (yet), or is closing: ask again shortly
                time.sleep(RETRY)
                self._follow(reply)

    def _lead_cycle(self, push: Push) -> torch.Tensor | None:
        """Lead this cycle: take this member's own ``push`` and wait for its book's answer; None if a
        lower member was taken back meanwhile (it leads again, and the push goes to it)."""
        rank = self.ctx.rank
        book = self._lead()
        book.take(rank, push, copy=False)
        self.hub.poke()  # held pushes may be answerable now
        return book.wait(rank, LEAD_POLL, give_up=lambda: self.election.leader != rank)

    def _follow(self, reply: Message) -> None:
        """After an answer that was not the aggregate: if it names a leader this member suspected,
        ping that one (a live peer vouches for it) and follow it if it answers; else find the
        leader again."""
        named = _named_leader(reply.meta)
        if named is None or not self.election.recheck(named):
            self.election.resolve()

    def _secure_exchange(self, push: Push) -> torch.Tensor | None:
        """Secure aggregation (``node.algorithms.secure``): this member's contribution masked, pushed, and
        unmasked with the others' through the leader the session was set up with."""
        ctx, limit = self.ctx, len(self.election.members) + 1
        if self._pusher is None:
            self._pusher = SecurePusher(ctx.rank, ctx.flat.state.numel() + 1, limit, self.privacy.masked_push)
        pusher, leader = self._pusher, self.election.leader
        if pusher.leader is not None and leader != pusher.leader and self.election.recheck(pusher.leader):
            leader = self.election.leader  # only suspected: it answers again
        if pusher.leader is not None and leader != pusher.leader:
            raise SecureAggregationFailed(f"secure aggregation: the leader, member {pusher.leader}, was lost; a secure "
                                          "session does not fail over to another leader (the task stops)")
        call = self._local_call if leader == ctx.rank else self._remote_call(leader)
        if pusher.leader is None:
            pusher.set_up(leader, push.cycle, call, sorted(self.election.members))
        reply = pusher.exchange(push.cycle, self._contribution(push), LeaderMember.fields(push), call)
        if reply.meta.get("keep"):
            return None
        problem = ctx.flat.check_compatible({k: v for k, v in reply.tensors.items() if not k.startswith("sa.")})
        if problem:
            raise WireError(f"a secure aggregate that does not fit this model: {problem}")
        return torch.cat([reply.tensors[name] for name in ctx.flat.ranges])

    def _contribution(self, push: Push) -> np.ndarray:
        """What this member adds to a cycle's sum: its model times its weight (its samples, 1 where the
        weighting is equal, 0 where a fraction's draw left it out or its model is not finite), then the
        weight (``LeaderMember.weight``)."""
        weight = self.member.weight(push.cycle, sorted(self.election.members))
        state = push.state.to(torch.float64)
        if not bool(torch.isfinite(state).all()) or float(state.abs().max()) * max(weight, 1.0) * \
                len(self.election.members) >= RING_LIMIT:
            log.warning("node %d: its model of cycle %d is not finite, or too large for the secure sum's fixed "
                        "point: it adds nothing to the sum", self.ctx.rank, push.cycle)
            weight = 0.0
        return np.append((state * weight).numpy() if weight else np.zeros(state.numel()), weight)

    def _remote_call(self, leader: int):
        """Calls to ``leader``, sent again while it says it does not lead yet or a call was refused on the way
        (every secure request is taken once however often it comes), for up to three peer timeouts."""
        def call(meta: dict, tensors: dict):
            deadline = time.monotonic() + 3 * self.timeout
            while True:
                reply = self._caller().call(leader, self.timeout, tensors, meta, patience=lambda: not (
                    self.election.is_dead(leader) or self._stop.is_set()))
                again = reply is not None and (reply.meta.get("status") in ("not-leader", "not-yet")
                                               or is_refusal(reply))
                again = again or (reply is None and self.election.recheck(leader))  # only suspected: it answers
                if not again or time.monotonic() > deadline:
                    return reply
                time.sleep(RETRY)
        return call

    def _local_call(self, meta: dict, tensors: dict):
        """A request of the leader's own member to its own book, answered as a member's is."""
        from types import SimpleNamespace

        request = SimpleNamespace(meta=meta, tensors=tensors, sender=self.ctx.rank)
        answer = self.respond(request)
        while answer is None:
            self.check()
            time.sleep(0.01)
            answer = self.release([self.ctx.rank]).get(self.ctx.rank)
        return SimpleNamespace(meta=dict(answer.meta), tensors=dict(answer.tensors))

    def _lead(self, start: bool = False) -> LeaderState:
        with self._lock:
            if self.state is None:
                alive = [m for m in self.election.members if not self.election.is_dead(m)]
                self.state = LeaderState.of(self.settings, alive, self.ctx.rank, self.ctx.seed, self.timeout,
                                            start=start, group=self.election.members, rule=self.rule,
                                            watch=self.watch)
                self.state.noise = self.privacy.noise  # central DP's, on each cycle's aggregate (None: none)
                if self.privacy.masks:
                    self._secure = SecureBook(self.ctx.flat.state.numel() + 1, self.state.heard_lately,
                                              len(self.election.members) + 1)
            return self.state

    def task_report(self) -> dict:
        """Synchronous: how many models each cycle's aggregate took, of the cycles this member led."""
        book = self.state
        if book is None or not book.sync:
            return {}
        return {"cycle_models": {str(cycle): count for cycle, count in sorted(book.rounds.items())}}

    # --- calls to other members (from the training and the watcher thread) ----------------------

    def _ping(self, rank: int) -> bool:
        """Whether ``rank`` answers (an answer that says the ping was refused on the way counts)."""
        reply = self._caller().call(rank, min(PING_TIMEOUT, self.timeout / 2), meta={"op": "ping"})
        return reply is not None

    def _caller(self) -> Caller:
        caller = getattr(self._callers, "caller", None)
        if caller is None:
            caller = self._callers.caller = self.hub.caller()
        return caller

    def _lost(self, rank: int) -> None:
        book = self.state  # (read once: a member that steps down drops it)
        if book is not None:
            book.mark_lost(rank)

    def _taken_back(self, rank: int) -> None:
        """A suspected member answers again: if it leads now, this member steps down, and the pushes
        it holds are answered with the leader to follow."""
        log.info("node %d: member %d answers again (it was only slow); the leader is %d", self.ctx.rank, rank,
                 self.election.leader)
        self._step_down()
        self.hub.poke()

    def _step_down(self) -> None:
        """Drop this member's book if it no longer leads (a lower member was taken back): a later turn
        to lead starts a fresh book, not one whose members all look silent. Secure aggregation keeps
        its session's book (a session never changes leader)."""
        if self.privacy.masks:
            return
        with self._lock:
            if self.state is not None and self.election.leader != self.ctx.rank:
                self.state = None

    def _not_leader(self) -> Answer:
        """The answer of a member that does not lead: the leader it follows."""
        return Answer(meta={"status": "not-leader", "leader": self.election.leader})

    # --- the hub's serving thread -------------------------------------------------------------

    def respond(self, request: Message) -> Answer | None:
        """A ping is answered at once; a push is recorded, and answered when the book allows."""
        op, sender, election = request.meta.get("op"), request.sender, self.election
        if op == "ping":
            book = self.state
            if book is not None:
                book.touch(sender)
            return Answer(meta={"status": "alive"})
        if op not in ("push", "join", "sa-meet", "sa-offer", "reveal"):
            raise WireError(f"unknown leader request {op!r}")
        if election is None or election.leader != self.ctx.rank:
            if election is None:
                return Answer(meta={"status": "not-leader"})
            election.poke()  # a member pushes here: perhaps the leader this one knows is gone
            return self._not_leader()
        if self.privacy.masks:
            return self._respond_secure(op, sender, request)
        if op == "join":  # a newcomer: a member from now on, given the group's model and cycle
            samples = meta_number(request.meta, "samples")
            if samples is None or not samples.is_integer() or samples < 0:
                raise WireError("a join that does not say its samples")
            joined = self._lead().join(sender, int(samples), self.ctx.flat.state)
            if joined is None:  # a leader that just took over: the members' pushes come first
                return Answer(meta={"status": "not-yet"})
            model, cycle = joined
            return Answer(self.ctx.flat.segments_of(model), {"status": "ok", "cycle": cycle})
        return self._take(sender, request)

    def _take(self, sender: int, request: Message) -> Answer | None:
        """A member's push: checked, recorded in the book, and answered if the book allows it now (else
        held by the hub until ``release`` answers it)."""
        fields = _push_fields(request.meta)
        problem = self.ctx.flat.check_compatible(request.tensors) or (None if fields else "bad samples, final or cycle")
        if problem:
            self.watch.refused(sender, problem)
            raise WireError(f"a push that does not fit this run: {problem}")
        samples, final, cycle = fields
        vector = torch.cat([request.tensors[name] for name in self.ctx.flat.ranges])
        if not self._lead().take(sender, Push(vector, samples, cycle, final, meta_number(request.meta, "loss", None)),
                                 copy=False):
            raise WireError(f"a push of {sender}'s cycle {cycle}, older than one the leader has")
        return self.release([sender]).get(sender)

    def _respond_secure(self, op: str, sender: int, request) -> Answer | None:
        """Secure aggregation's requests (``node.algorithms.secure``): recorded, then answered by ``release``."""
        book, secure = self._lead(), self._secure
        if op == "join":
            raise WireError("a join of a secure session, which takes no newcomers")
        if sender not in book.contributions:
            raise WireError(f"a secure request from {sender}, not a member of the session")
        book.touch(sender)
        cycle = meta_number(request.meta, "cycle", None)
        if op != "sa-meet" and (cycle is None or not cycle.is_integer()):
            raise WireError(f"a secure {op} without its cycle")
        cycle = -1 if cycle is None else int(cycle)
        limit = len(self.election.members) + 1
        try:
            if op == "sa-meet":
                identity = request.tensors.get("sa.id")
                if identity is None or identity.dtype != torch.uint8 or identity.dim() != 1:
                    raise WireError("a meeting without its identity key")
                secure.meet(sender, identity.numpy().tobytes())
            elif op == "sa-offer":
                offer = read_push(request.tensors, 0, limit).offer
                secure.offer(sender, cycle, offer)
            elif op == "push":
                fields = _push_fields(request.meta)
                if fields is None:
                    raise WireError("a secure push without its samples, final flag or cycle")
                samples, final, cycle = fields
                masked = read_push(request.tensors, secure.length, limit)
                with self._secure_lock:  # the cycle closes on the book's word: it must have the masked model first
                    try:
                        secure.push(sender, cycle, masked)
                    except StaleCycle:  # a member back after it was lost: the newest aggregate, at once
                        return self._catch_up(sender)
                    if not book.take(sender, Push(torch.zeros(1), samples, cycle, final,
                                                  meta_number(request.meta, "loss", None)), copy=False):
                        raise WireError(f"a push of {sender}'s cycle {cycle}, older than one the leader has")

            else:  # reveal
                secure.reveal(sender, cycle, unpack(request.tensors, "sa.rb", OPEN_BYTES, limit),
                              unpack(request.tensors, "sa.rk", OPEN_BYTES, limit))
        except SecureAggregationFailed as failure:
            return Answer(meta={"status": "failed", "reason": str(failure)})
        except WireError as error:  # said to the member, which stops with it (a secure request never comes again)
            self.watch.refused(sender, str(error))
            return Answer(meta={"status": "refused", "reason": str(error)[:500]})
        with self._lock:
            self._held_ops[sender] = (op, cycle)
        self.hub.poke()
        return self._release_secure([sender]).get(sender)

    def _catch_up(self, sender: int) -> Answer:
        """The answer to a push of a cycle the group is past: the newest aggregate, not counting it (the
        member trains on from it, and is one of the members again once it pushes the group's cycle)."""
        latest = self._secure.latest()
        if latest is None:
            raise WireError(f"a secure push from {sender} of a cycle this leader does not keep")
        model, round_ = latest
        return Answer({**self.ctx.flat.segments_of(model), "sa.pks": pack_keys(round_.next_publics()),
                       "sa.k": pack(round_.offered_to(sender), SEALED_BYTES)}, {"status": "ok"})

    def _release_secure(self, held: list[int]) -> dict[int, Answer]:
        """The answers secure aggregation can give now to ``held`` requests (see ``node.algorithms.secure``)."""
        book, secure, answers = self.state, self._secure, {}
        for sender in held:
            with self._lock:
                op, cycle = self._held_ops.get(sender, (None, None))
            try:
                answer = self._secure_answer(book, secure, sender, op, cycle)
            except (SecureAggregationFailed, WireError) as failure:  # WireError: shares that rebuild no secret
                secure.failure = secure.failure or f"secure aggregation failed: {failure}"
                answer = Answer(meta={"status": "failed", "reason": secure.failure})
            if answer is not None:
                answers[sender] = answer
                with self._lock:
                    self._held_ops.pop(sender, None)
        return answers

    def _secure_answer(self, book: LeaderState, secure: SecureBook, sender: int, op: str | None, cycle: int
                       ) -> Answer | None:
        if secure.failure:
            raise SecureAggregationFailed(secure.failure)
        if op == "sa-meet":
            identities = secure.everyone_met(sorted(book.contributions))
            return None if identities is None else Answer({"sa.ids": pack_keys(identities)}, {"status": "ok"})
        if op == "sa-offer":
            setup = secure.setup_done()
            return None if setup is None else Answer({"sa.pks": pack_keys(setup.next_publics()),
                                                      "sa.k": pack(setup.offered_to(sender), SEALED_BYTES)},
                                                     {"status": "ok"})
        if op not in ("push", "reveal"):
            return None
        with self._secure_lock:
            if not book.ready(sender):
                return None
            round_ = secure.close(cycle)
        if op == "push" and sender in round_.survivors and sender not in round_.revealed:
            return Answer({"sa.b": pack(round_.sealed_for(sender), SEALED_BYTES)},
                          {"status": "reveal", "survivors": round_.survivors, "dropped": round_.dropped})
        known, total = secure.total(cycle)
        if not known:
            return None
        book.rounds[cycle] = len(round_.survivors)
        tensors = {"sa.pks": pack_keys(round_.next_publics()), "sa.k": pack(round_.offered_to(sender), SEALED_BYTES)}
        if total is None:
            return Answer(tensors, {"status": "ok", "keep": True})
        model = secure.model(cycle, lambda: self._secure_aggregate(total))
        return Answer({**self.ctx.flat.segments_of(model), **tensors}, {"status": "ok"})

    def _secure_aggregate(self, total: np.ndarray) -> torch.Tensor:
        """The unmasked weighted mean; with central DP, noised for its count of models (equal weighting:
        the total weight, which leaves out the members a fraction's draw did not take)."""
        mean, noise = weighted_mean(total, self.ctx.flat.state.dtype), self.privacy.noise
        return mean if noise is None else noise(mean, int(round(total[-1])))

    def release(self, held: list[int]) -> dict[int, Answer]:
        """Answers for those of the ``held`` pushes (by member) that the book allows now."""
        if self.privacy.masks:
            return self._release_secure(held) if self._secure is not None else {}
        if self.election is not None and self.election.leader != self.ctx.rank:  # stepped down
            return dict.fromkeys(held, self._not_leader())
        book = self.state
        answers = book.release(held) if book is not None else {}
        return {sender: Answer(self.ctx.flat.segments_of(aggregate), {"status": "ok"})
                for sender, aggregate in answers.items()}


def _named_leader(meta: dict) -> int | None:
    """The rank a "not-leader" answer names as the leader its member follows, if it names one."""
    rank = meta_number(meta, "leader", None) if meta.get("status") == "not-leader" else None
    return int(rank) if rank is not None and rank.is_integer() else None


def _push_fields(meta: dict) -> tuple[int, bool, int] | None:
    """A push's samples, final flag and cycle, or None where its metadata does not hold them."""
    samples, final = meta_number(meta, "samples"), meta.get("final")
    cycle = meta_number(meta, "cycle") if "cycle" in meta else None
    if samples is None or not isinstance(final, bool) or cycle is None or not cycle.is_integer():
        return None
    return int(samples), final, int(cycle)
