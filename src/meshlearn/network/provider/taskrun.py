"""One provider's part of a task: get the data, train with the task's algorithm, agree on the result.

The engine's Node trains, with the task's algorithm (``leader``, ``dpsgd`` or ``gossip``) over
the engine's own endpoints between the task's providers. Then every algorithm ends the same way
(``finish.Finisher``): final models go to the leader, which aggregates, evaluates, and copies the
result to every provider.

A run's state (``RunState``) moves only along ``NEXT``; every change is reported to the provider
at once (``on_change``), so the bootstrap learns that a provider is free the moment its part ends.
"""

from __future__ import annotations

import enum
import logging
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from meshlearn.checkpoint import FOLDER as CHECKPOINTS
from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import (
    BadMessage,
    ConfigError,
    NetworkError,
    TaskCancelled,
    TopologyError,
)
from meshlearn.models import build_model, load_weights
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.punch import PunchMemory
from meshlearn.network.protocol.providerapi import (
    MAX_ERROR,
    Kept,
    Pong,
    Provider,
    PunchPorts,
    Push,
    PushAnswer,
    ResultCopy,
    RunStatus,
)
from meshlearn.network.provider.enginelinks import EngineLinks
from meshlearn.network.provider.finish import Finisher
from meshlearn.network.provider.natside import NatSide
from meshlearn.network.provider.taskdata import (
    checkpoint_sender,
    chunk_source,
    task_dataset,
)
from meshlearn.network.provider.testhooks import NO_HOOKS, TestHooks
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.datashare import download
from meshlearn.network.task.resources import machine_cores
from meshlearn.network.task.spec import MAX_TASK_PEERS, WEIGHTS_FILE, Peer, TaskSpec
from meshlearn.network.task.state import SentCheckpoints, fetch_checkpoint
from meshlearn.node import Node, make_transport
from meshlearn.settings import DEFAULT_MAX_MESSAGE_MB, message_bytes
from meshlearn.topology import build_topology
from meshlearn.wire.sealed import FrameSeal

log = logging.getLogger(__name__)

START_TIMEOUT = 600.0
CANCEL_WAIT = 2.0  # seconds task.cancel waits for the run to stop, so the provider is free when it answers


class RunState(str, enum.Enum):
    """Where a provider's part of a task stands."""

    PREPARING = "preparing"
    READY = "ready"
    TRAINING = "training"
    FINISHING = "finishing"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def active(self) -> bool:
        """Whether the provider is still busy with the task."""
        return self in ACTIVE


ACTIVE = frozenset({RunState.PREPARING, RunState.READY, RunState.TRAINING, RunState.FINISHING})
_ENDS = {RunState.FAILED, RunState.CANCELLED}
NEXT: dict[RunState, frozenset[RunState]] = {
    RunState.PREPARING: frozenset({RunState.READY, *_ENDS}),
    RunState.READY: frozenset({RunState.TRAINING, *_ENDS}),
    RunState.TRAINING: frozenset({RunState.FINISHING, *_ENDS}),
    RunState.FINISHING: frozenset({RunState.DONE, *_ENDS}),
    RunState.DONE: frozenset(),
    RunState.FAILED: frozenset(),
    RunState.CANCELLED: frozenset(),
}


@dataclass
class ProviderContext:
    """What a task run may use of its provider: identity, secret, folders, device, limits, clock."""

    id: str
    host: str  # the task engine listens here
    secret: bytes
    workdir: Path
    device: str = "cpu"
    data_root: Path | None = None
    max_message_mb: float = DEFAULT_MAX_MESSAGE_MB  # the provider's cap on a message (ProviderSettings)
    clock: Clock = field(default=SYSTEM)
    public_host: str = ""  # where peers reach the engine, if not ``host`` (which may be 0.0.0.0)
    expose: Callable[[int, str], tuple[str, Callable[[], None]]] | None = None  # (engine port, task) -> where peers reach it
    hooks: TestHooks = NO_HOOKS  # tests only: a forged model, an emulated network on its engine links
    keep_data: bool = False  # keep a task's data shard once it ended (else it is deleted; the result is kept)
    cores: int | None = None  # the provider's declared cores (None: this machine's, and torch's own default)
    relayed: bool = False  # peers reach this provider through the relay (its address is the relay's)
    nat: NatSide | None = None  # behind NAT: where it learns its public mappings, for punching
    punch_memory: PunchMemory = field(default_factory=PunchMemory)  # the provider's: peers punching failed with

    @property
    def max_message_bytes(self) -> int:
        """The provider's cap on a message in bytes, as the task's engine and RPCs enforce it."""
        return message_bytes(self.max_message_mb)

    def reach(self, port: int, task_id: str) -> tuple[str, Callable[[], None]]:
        """HOST:PORT where peers reach this machine's ``port`` (task ``task_id``'s engine), and what
        stops that (the relay's agent)."""
        if self.expose is not None:
            return self.expose(port, task_id)
        return f"{self.public_host or self.host}:{port}", lambda: None


class TaskRun:
    """A task on this provider; ``run()`` does the work, the ``on_*`` methods answer its peers."""

    def __init__(self, spec: TaskSpec, ctx: ProviderContext, task_key: bytes, access: TaskAccess,
                 on_change: Callable[[TaskRun], None] | None = None, fresh: bool = False):
        self.spec = spec
        self.ctx = ctx
        self.task_key = task_key  # the requester's, for this run of the task only: seals every engine message
        self.access = access  # who may act on the task (its requester, its providers)
        self.fresh = fresh  # an earlier attempt of this task ran here: its files go first
        self.ids = [p.id for p in spec.peers]
        if ctx.id not in self.ids:
            raise BadMessage(f"task {spec.task_id} does not list this provider ({ctx.id})")
        self.index = self.ids.index(ctx.id)
        self.folder = ctx.workdir / "tasks" / spec.task_id
        self.finisher = Finisher(spec, ctx, self.index)
        self.error: str | None = None
        self.progress: dict = {}
        self.links = EngineLinks(ctx, spec.task_id, self.index, spec.handshake_timeout)  # where peers reach the engine, and its links to them
        self.node: Node | None = None
        self.iterations = 0
        self._state = RunState.PREPARING
        self._on_change = on_change
        self._book: dict[int, str] = {}
        self._lock = threading.Lock()
        self._start = threading.Event()
        self._cancelled = threading.Event()
        self._ended = threading.Event()

    @property
    def state(self) -> RunState:
        return self._state

    def _move(self, to: RunState) -> None:
        """Change state along ``NEXT`` only (a run that ended stays ended), and say so."""
        with self._lock:
            if to not in NEXT[self._state]:
                raise RuntimeError(f"task {self.spec.task_id}: no move from {self._state.value} to {to.value}")
            self._state = to
        if self._on_change is not None:
            self._on_change(self)

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        """Prepare, wait for the requester's start, train, finish; record a failure instead of raising."""
        stop_watching = threading.Event()
        try:
            self._prepare()
            self._move(RunState.READY)
            if not self.ctx.clock.wait(self._start, START_TIMEOUT):
                raise NetworkError(f"the requester never started task {self.spec.task_id}")
            self._check_cancelled()
            self._move(RunState.TRAINING)
            self.finisher.started_at = self.ctx.clock.monotonic()
            election = self.finisher.election
            threading.Thread(target=election.watch, name=f"task-watch-{self.spec.task_id}", daemon=True,
                             args=(stop_watching, max(0.2, self.spec.peer_timeout / 4), self.ctx.clock)).start()
            book = self.links.settle(self._book).give(self.node.transport)  # punched paths: the engine's own
            self.node.run(book)
            if said := self.links.describe():  # which links crossed a NAT, and how
                print(f"provider {self.ctx.id}: task {self.spec.task_id}'s links: {said}", flush=True)
            self._move(RunState.FINISHING)
            self.finisher.finish(self.progress.get("iteration", 0), self._check_cancelled,
                                 self.progress.get("train_loss"))
            self._move(RunState.DONE)
        except TaskCancelled:
            log.warning("task %s cancelled", self.spec.task_id)
            self._end(RunState.CANCELLED)
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("task %s failed on %s", self.spec.task_id, self.ctx.id)
            self._end(RunState.FAILED)
        finally:
            stop_watching.set()
            self.finisher.election.poke()
            if self.node is not None:  # cancelled before it ran: its endpoint was bound, never closed
                self.node.transport.close()
            self.node = None  # model, data and buffers: the result is on disk (a provider runs many tasks)
            if not self.ctx.keep_data:  # the shard on disk too: a provider would otherwise keep every task's
                shutil.rmtree(self.folder / "data", ignore_errors=True)
            shutil.rmtree(self.folder / CHECKPOINTS, ignore_errors=True)  # the requester keeps the task's state
            self.links.close()
            self.finisher.release()
            self._ended.set()

    def _end(self, state: RunState) -> None:
        if self._state.active:
            self._move(state)

    def _prepare(self) -> None:
        spec, ctx = self.spec, self.ctx
        if self.fresh:  # the requester started the task again without some provider: new shards
            shutil.rmtree(self.folder / "data", ignore_errors=True)
        self.access.save(self.folder)
        dataset, indices = task_dataset(spec, self.index, self.folder / "data", ctx.secret, ctx.id, ctx.data_root,
                                        before_chunk=self._check_cancelled)
        config = spec.experiment_config(len(indices), ctx.host, ctx.device, ctx.max_message_mb)
        if ctx.hooks.model_poison:  # a poisoning provider, for tests of robust aggregation: it sends forged models
            config = config.model_copy(update={"byzantine": f"{self.index}:{ctx.hooks.model_poison}"})
        if ctx.hooks.engine_net:  # slow, lossy links emulated between providers on one machine (tests and benchmarks)
            config = config.model_copy(update={"net": ctx.hooks.engine_net})
        graph = build_topology("full", config.nodes, spec.seed)
        threads = self.threads()
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(spec.seed)  # every provider starts from the same model
        model = build_model(spec.model, dataset.input_shape, dataset.num_classes)
        if spec.weights is not None:  # the requester's initial weights replace the seeded ones
            if spec.weights.size > ctx.max_message_bytes:
                raise BadMessage(f"initial weights of {spec.weights.size} bytes exceed this provider's "
                                 f"{ctx.max_message_bytes}-byte limit")
            path = download(chunk_source(spec.weights.address, ctx.secret, ctx.id), WEIGHTS_FILE,
                            spec.weights.model_dump(), self.folder / "data", source=spec.weights.address,
                            before_chunk=self._check_cancelled)
            load_weights(model, str(path))
        if config.transport == "udp" and ctx.relayed and ctx.nat is None:
            raise BadMessage(f"task {spec.task_id} asks for transport udp, but peers reach this provider only "
                             "through the bootstrap's relay, which carries TCP: ask with --transport tcp, or run "
                             "providers that can be dialed")
        seal = FrameSeal(self.task_key)
        checkpoints, resume = None, None
        if spec.checkpoints_to or spec.resume is not None:  # kept here, sent to the requester
            send = checkpoint_sender(spec.checkpoints_to, spec.task_id, self.index, ctx.secret, ctx.id) \
                if spec.checkpoints_to else None
            checkpoints = SentCheckpoints(self.folder, self.index, spec, send)
        if spec.resume is not None:  # a task that goes on from the checkpoints its requester kept
            fetch_checkpoint(spec, self.index, self.folder, chunk_source(spec.resume.address, ctx.secret, ctx.id),
                             before_chunk=self._check_cancelled)
            resume = spec.resume.cycles[self.index]
        self.node = Node(self.index, config, graph, dataset, indices, model,
                         lambda flat: make_transport(config, self.index, flat, ctx.host, 0, seal=seal),
                         checkpoints=checkpoints, resume=resume, joining=spec.joining, members=self._members())
        bound = self.node.transport.bind()  # tcp:// or udp://HOST:PORT, HOST possibly 0.0.0.0 ("" when alone)
        self.links.expose(bound, lambda: self.node.transport.datagram_socket, len(spec.peers))
        self.node.hooks.append(self._after_iteration)
        self.iterations = config.iterations
        self.finisher.attach(self.node, len(indices))

    def _members(self) -> list[int] | None:
        """The providers of a task that takes in more as it runs (every one but this, for a newcomer);
        None: a task that keeps those it starts with."""
        spec = self.spec
        if not spec.joining and not spec.slots:
            return None
        return [i for i in range(len(spec.peers)) if not (spec.joining and i == self.index)]

    def threads(self) -> int | None:
        """The torch threads this part trains with: the declared cores, shared with the task's other
        providers on this machine (those announcing this one's host): two providers of a task on 2
        cores, 2 threads each, starved one another (the follower at a fifth of the leader's pace).
        None: torch's own default (this machine's cores, or OMP_NUM_THREADS)."""
        cores = self.ctx.cores
        def host(address: str) -> str:
            return address.split("@")[0].rpartition(":")[0]

        here = host(self.spec.peers[self.index].address)
        alongside = 1 if self.ctx.relayed else sum(host(p.address) == here for p in self.spec.peers)
        if cores is None and alongside == 1:
            return None
        return max(1, (cores or machine_cores()) // alongside)

    def cancel(self, wait: float = CANCEL_WAIT) -> None:
        """Stop this task at its next data chunk or iteration (the requester gave up on it, or the
        provider stops); return once it has stopped, or after ``wait`` seconds."""
        self._cancelled.set()
        self._start.set()
        self._ended.wait(wait)

    def _check_cancelled(self) -> None:
        if self._cancelled.is_set():
            raise TaskCancelled(self.spec.task_id)
        self.finisher.check_admitted()

    def exclude(self, index: int, why: str) -> None:
        """Go on without provider ``index`` (its key was revoked): it is never waited for, never
        followed as leader, and its result is never taken."""
        node = self.node
        if node is not None:
            node.algorithm.exclude(index)
        if self.finisher.exclude(index):
            log.warning("task %s: provider %s is out of the task: %s", self.spec.task_id, self.ids[index], why)

    def add_peer(self, peer: Peer, engine: str, at: int | None = None) -> None:
        """A provider that joins the task while it trains (its next index): taken in by this
        provider's engine (``at``: from that round, where the algorithm takes members in at one),
        its final aggregation and its checks of who may act on the task."""
        index = len(self.spec.peers)
        if index >= MAX_TASK_PEERS or peer.shard is not None and peer.shard >= self.spec.shards:
            raise BadMessage(f"task {self.spec.task_id} has no place for another provider (its {index + 1}th, "
                             f"shard {peer.shard} of {self.spec.shards})")
        if self._state not in (RunState.READY, RunState.TRAINING) or self.node is None:
            raise BadMessage(f"{self.ctx.id} takes no provider into task {self.spec.task_id} now "
                             f"(state {self._state.value})")
        try:
            self.node.algorithm.add_member(index, engine, at)
        except (ConfigError, TopologyError) as exc:
            raise BadMessage(str(exc)) from None
        self.spec = self.spec.model_copy(update={"peers": [*self.spec.peers, peer]})
        self.ids.append(peer.id)
        self.access = TaskAccess.of(self.spec, self.access.requester)
        self.access.save(self.folder)
        self.finisher.add(self.spec)
        self._book[index] = engine
        log.info("task %s: provider %s joined as provider %d", self.spec.task_id, peer.id, index)

    def withdraw(self, peer: Peer) -> None:
        """A provider ``add_peer`` took in that will not come after all (some other member could not
        take it in at its round): gone on without, as a revoked one is."""
        if peer.id not in self.ids[:-1] and self.ids and self.ids[-1] == peer.id:
            self.exclude(len(self.ids) - 1, "it could not join the task at its round")
        else:
            raise BadMessage(f"task {self.spec.task_id}: {peer.id} is not the provider that joined last")

    def _after_iteration(self, node: Node, iteration: int, record: dict) -> None:
        self._check_cancelled()
        if iteration == 0:  # those shut out while the run was being prepared (connect knew them still)
            for index in self.finisher.excluded:
                node.algorithm.exclude(index)
        evaluated = "test_acc" in record
        self.progress = {"iteration": iteration + 1, "iterations": self.iterations,
                         "train_loss": record.get("train_loss"), "leader": self.ids[self.finisher.election.leader],
                         "test_acc": record["test_acc"] if evaluated else self.progress.get("test_acc"),
                         "evaluated_at": iteration + 1 if evaluated else self.progress.get("evaluated_at")}

    # ---- answering peers and the requester --------------------------------------------------

    def start(self, book: dict[int, str], joins_at: int | None = None,
              punches: dict[int, PunchPorts] | None = None) -> None:
        """The requester's go: every provider is ready; ``book`` holds the engine addresses
        (``joins_at``: a newcomer's round, where its algorithm takes members in at one; ``punches``:
        the providers' punching ports)."""
        if self.spec.joining:  # a newcomer: the providers the task lost before it came are none of its peers
            for index in sorted(set(range(len(self.spec.peers))) - set(book) - {self.index}):
                self.exclude(index, "it was lost before this provider joined")
        self._book = {j: a for j, a in book.items() if j != self.index and j not in self.finisher.excluded}
        self._book = self.links.route(self._book, dict(enumerate(self.ids)),
                                      {j: p for j, p in (punches or {}).items() if j != self.index},
                                      self.node is not None and self.node.transport.meets)
        if joins_at is not None and self.node is not None:
            self.node.algorithm.join_round = joins_at
        self._start.set()

    def on_push(self, message: Push, req: Envelope) -> PushAnswer:
        if self._state in (RunState.PREPARING, RunState.FAILED):
            raise BadMessage(f"{self.ctx.id} is not ready for models (state {self._state.value})")
        return self.finisher.on_push(message, req)

    def on_ping(self, message: Provider, req: Envelope) -> Pong:
        return self.finisher.on_ping(message, req).model_copy(update={"state": self._state.value})

    def on_results(self, message: ResultCopy, req: Envelope) -> Kept:
        return self.finisher.on_results(message, req)

    def status(self, leaving: bool = False) -> RunStatus:
        """Where this run stands (``leaving``: whether its provider is leaving the network)."""
        return RunStatus(task=self.spec.task_id, index=self.index, state=self._state.value,
                         error=self.error[:MAX_ERROR] if self.error is not None else None,
                         engine=self.links.address, progress={**self.progress, "links": self.links.report()},
                         leader=self.ids[self.finisher.election.leader], results=self.finisher.result.ready.is_set(),
                         leaving=leaving, punch=self.links.punch)
