"""What every part of a requester shares about its one task: the request and its record, the
lines to the bootstrap and the providers, who is in the task (``Roster``), where it stands
(``TaskLifecycle``) and what the dashboard is told (``TaskWatch``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import InitVar, dataclass, field
from pathlib import Path

from meshlearn.clock import Clock
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.protocol.providerapi import PunchPorts
from meshlearn.network.requester.lifecycle import TaskLifecycle
from meshlearn.network.requester.links import BootstrapLink, ProviderLink
from meshlearn.network.requester.taskwatch import TaskWatch
from meshlearn.network.task.resources import MemoryEstimate
from meshlearn.network.task.spec import TaskRequest, TaskSpec
from meshlearn.network.task.state import KeptCheckpoints, TaskRecord
from meshlearn.tblog import ScalarLog
from meshlearn.wire.sealed import FrameSeal

Say = Callable[[str], None]
ENDED = ("done", "failed", "cancelled")  # a provider's states once its part of the task ended
POLL = 0.25  # seconds between looks at the providers' status
STATUS_TIMEOUT = 5.0  # seconds a started provider may take to say its status (one that takes longer is gone)
READY_TIMEOUT = 600.0  # seconds a provider may take to prepare the task (data download, model build)
ASSIGN_TIMEOUT = 15.0  # a provider answers task.assign after one check with the bootstrap
SETTLE_EXTRA = 10.0  # seconds beyond the peer timeout that providers get to end their part after the result


@dataclass
class Roster:
    """Who is in the task: the providers it lost, those that left, those left out before the
    start and who took their place, the keys its data server admits and the engines it started."""

    gone: set[str] = field(default_factory=set)  # providers out of the task: stopped answering, or revoked
    left: set[str] = field(default_factory=set)  # providers that went once their part had ended (not lost)
    ended: dict[str, bool] = field(default_factory=dict)  # whether each one's last status said its part had ended
    revoked: set[str] = field(default_factory=set)  # providers whose keys the bootstrap revoked (never asked for a result)
    left_out: dict[str, str] = field(default_factory=dict)  # providers that could not take the task, and why
    replaced: dict[str, str] = field(default_factory=dict)  # a provider left out or lost -> the one in its place
    admitted: set[str] = field(default_factory=set)  # the keys the data server answers: the providers, the bootstrap
    engines: dict[str, str] = field(default_factory=dict)  # engine address of each ready provider, by index
    punch: dict[str, PunchPorts] = field(default_factory=dict)  # punching ports of each ready provider, by index
    links: dict[str, dict] = field(default_factory=dict)  # each provider's engine links, as its last status said
    joins_closed: bool = False  # a D-PSGD newcomer some member could not take in: no other joins

    def in_task(self, provider: str) -> bool:
        """Whether ``provider`` is still asked about the task (neither lost nor gone once its part ended)."""
        return provider not in self.gone and provider not in self.left

    def note_revoked(self, revoked: Iterable[str]) -> set[str]:
        """Remember the providers the bootstrap says were revoked (never trusted again); returns them all."""
        self.revoked.update(revoked)
        return self.revoked

    def extra(self) -> dict:
        """What the requester adds to the result's metrics: providers left out before the start,
        those claimed in their place, and each provider's engine links (direct, punched or relayed,
        and the bytes each sent through the relay)."""
        return {**({"left_out": dict(self.left_out)} if self.left_out else {}),
                **({"replaced": dict(self.replaced)} if self.replaced else {}),
                **({"links": dict(self.links)} if self.links else {})}

    def note_links(self, provider: str, progress: dict) -> None:
        """Keep the engine links a provider's status reports (free-form, from the network: kept as
        it came only where it is a mapping)."""
        links = progress.get("links")
        if isinstance(links, dict) and links:
            self.links[provider] = links


@dataclass(frozen=True)
class Resume:
    """A task that goes on from checkpoints: their ``cycles`` (one per position), the providers
    that held the positions then (asked for first, each for its own) and the fingerprint of the
    training it must go on with."""

    cycles: list[int]
    providers: list[str]
    fingerprint: str

    @classmethod
    def of(cls, record: TaskRecord, cycles: list[int] | None) -> Resume | None:
        """How the task of ``record`` resumes from ``cycles`` (None: it does not)."""
        return None if cycles is None else cls(cycles, list(record.providers or []), record.fingerprint)


@dataclass
class TaskContext:
    """One task as its requester's collaborators see it (``scalars``: where its curves go, if anywhere)."""

    request: TaskRequest
    record: TaskRecord  # task.json in ``output``: what ``request --resume`` reads
    secret: bytes
    output: Path
    say: Say
    clock: Clock
    bootstrap: BootstrapLink
    providers: ProviderLink
    keys: KeyPair | None = None  # None: plain ZeroMQ, for tests on loopback only
    resume: Resume | None = None
    scalars: InitVar[ScalarLog | None] = None
    roster: Roster = field(default_factory=Roster)
    # seals the providers' engine messages (CurveZMQ only): the run's, drawn afresh for every attempt (Starter),
    # so a message of an earlier run opens in no later one (it could take a sender's session there)
    task_key: bytes = field(default_factory=FrameSeal.new_key)
    estimate: MemoryEstimate | None = None  # the task's peak memory per provider (where the data is here)
    spec_now: TaskSpec | None = None  # the attempt under way (what checkpoints are checked against)
    lifecycle: TaskLifecycle = field(init=False)
    kept: KeptCheckpoints = field(init=False)  # the checkpoints the providers send, kept in ``output``
    watch: TaskWatch = field(init=False)  # the bootstrap's dashboard, TensorBoard

    def __post_init__(self, scalars: ScalarLog | None) -> None:
        self.lifecycle = TaskLifecycle(self.task_id, self.clock)
        self.kept = KeptCheckpoints(self.output)
        self.watch = TaskWatch(self.report, scalars, self.clock)

    @property
    def task_id(self) -> str:
        return self.record.task_id

    @property
    def sender(self) -> str:
        """The name the task's requests go under."""
        return self.providers.sender

    @property
    def slots(self) -> int:
        """The most providers the task takes (its data split as many ways) where more may join it as
        it runs (``min_providers``); 0: the task keeps the providers it starts with."""
        req = self.request
        return req.providers if req.min_providers is not None and req.min_providers < req.providers else 0

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether the task's providers send checkpoints here (``checkpoint_every`` is not 0)."""
        return self.request.checkpoint_every != 0

    def write_record(self, spec: TaskSpec | None = None) -> None:
        """Write the task's record (task.json) into ``output``; with ``spec`` (the attempt under way,
        started or grown) naming the providers that hold its positions now (``TaskRecord.note``)."""
        if spec is not None:
            self.record.note(spec)
        self.record.write(self.output)

    def report(self, body: dict) -> None:
        """One progress report for the bootstrap's dashboard (TaskWatch sends it); the reply names
        the task's providers whose keys were revoked since."""
        self.roster.note_revoked(self.bootstrap.progress(body))

    def lose(self, provider: str, why: str) -> None:
        """``provider`` is out of the task from now on (gone, or its key revoked): say so once."""
        if provider not in self.roster.gone:
            self.roster.gone.add(provider)
            self.watch.lost(provider)
            self.say(f"task {self.task_id}: provider {provider} {why}")
