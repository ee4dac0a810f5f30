"""The bodies of the requests the bootstrap answers, and of its replies (declared in ``rpcs``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from meshlearn.network.protocol.message import (
    Address,
    Count,
    Device,
    Id,
    Key,
    Message,
    Real,
    ShortText,
    Status,
    TaskId,
    Token,
)
from meshlearn.network.task.spec import MAX_TASK_PEERS

MAX_CANDIDATES = 1024  # provider ids a claim may list in its preferred order
MAX_LISTED = 100_000  # providers or keys a reply may list
MAX_PROGRESS = 1024  # providers a task's progress report may name
MAX_FAULTS = 32  # faults a task's progress report may name
PROGRESS_STATES = ("preparing", "ready", "training", "finishing", "done", "failed", "cancelled", "lost")
WantedDevice = Annotated[str, Field(pattern=r"^(any|gpu|cuda|mps|cpu)$")]
Location = Annotated[str, Field(max_length=64)]
Ids = Annotated[list[Id], Field(max_length=MAX_LISTED)]
ANNOUNCED_CHARS = 256 - 1 - 64  # an Address less "@" and a key: HOST:PORT@KEY, as the bootstrap hands it out, fits
Announced = Annotated[str, Field(min_length=1, max_length=ANNOUNCED_CHARS)]  # HOST:PORT a provider registers at


class Named(Message):
    """``ping``'s reply: the kind of service, and a provider's id."""

    service: Literal["bootstrap", "provider", "requester"]
    id: Id | None = None


class Fit(Message):
    """What a discovery or a claim asks of providers: the least RAM and cores, the device and
    location, and whether providers of other devices may fill in (``registry.select``)."""

    device: WantedDevice = "any"
    location: Location | None = None
    min_ram_gb: Annotated[Real, Field(ge=0)] = 0.0
    min_cores: Count = 0
    fallback: bool = False


class ProviderRecord(Message):
    """A provider as discovery and claims hand it out: its address carries the key the bootstrap vouches for."""

    id: Id
    address: Address
    ram_gb: Annotated[Real, Field(ge=0)]
    cores: Annotated[int, Field(ge=1, lt=1 << 20)]
    device: Device
    location: Location
    status: Literal["free", "busy", "leaving", "lost"]
    task: Id | None = None
    last_seen: Real = 0.0
    key: Annotated[str, Field(max_length=64)] = ""
    reachable: bool = True


class Providers(Message):
    """A list of providers (``discover``, ``claim``, ``claim.replace``)."""

    providers: Annotated[list[ProviderRecord], Field(max_length=MAX_LISTED)]


class Register(Message):
    """A provider announces itself: where it answers, what it has, what it does."""

    id: Id
    address: Announced
    ram_gb: Annotated[Real, Field(ge=0)]
    cores: Annotated[int, Field(ge=1, lt=1 << 20)]
    device: Device
    location: Location = ""
    status: Status = "free"
    task: Id | None = None
    last_task: Id | None = None  # the task it ran last (its heartbeat's; the registration's is not used)


class Registered(Message):
    """Whether the provider was recorded (its id), and if not, the relay to come back through."""

    registered: Id | None
    reachable: bool
    ttl: Annotated[Real, Field(gt=0)]
    relay: Address | None = None


class Heartbeat(Message):
    """A registered provider's sign of life, and what it does."""

    id: Id
    status: Status
    task: Id | None = None
    last_task: Id | None = None


class HeartbeatAnswer(Message):
    """Whether the bootstrap still knows the provider, its time to live, and the keys revoked."""

    known: bool
    ttl: Annotated[Real, Field(gt=0)]
    revoked: Annotated[list[Key], Field(max_length=MAX_LISTED)]


class ProviderId(Message):
    """A provider named by its id (``leave``)."""

    id: Id


class Left(Message):
    left: bool


class Discover(Fit):
    """Which providers to list: at most ``count``, the free ones only or all."""

    count: Annotated[int, Field(ge=1, le=MAX_LISTED)] = 100
    free_only: bool = True


class Claim(Fit):
    """Claim ``count`` free providers for task ``task``, in the requester's preferred ``order``.
    ``attempt``: the requester's name for this claim; the same claim sent again (its answer was lost,
    and another bootstrap is asked) gets the providers the first one took, and claims nothing more."""

    task: TaskId
    count: Annotated[int, Field(ge=1, le=MAX_TASK_PEERS)]
    order: Annotated[list[Id], Field(max_length=MAX_CANDIDATES)] = Field(default_factory=list)
    attempt: Token | None = None


class ClaimReplace(Fit):
    """Drop providers of the task that could not take it, claim ``count`` others (not ``exclude``)."""

    task: TaskId
    drop: Annotated[list[Id], Field(max_length=MAX_TASK_PEERS)]
    exclude: Annotated[list[Id], Field(max_length=4 * MAX_TASK_PEERS)] = Field(default_factory=list)
    count: Annotated[int, Field(ge=0, le=MAX_TASK_PEERS)]


class Release(Message):
    """End the task: free its providers, set aside those it ``lost``."""

    task: TaskId
    status: Annotated[str, Field(min_length=1, max_length=32)] = "done"
    lost: Annotated[list[Id], Field(max_length=MAX_TASK_PEERS)] = Field(default_factory=list)


class Released(Message):
    released: bool


class TaskName(Message):
    """A task named by its id."""

    task: TaskId


class Member(Message):
    """A provider of a task, as the task's record lists it."""

    id: Id
    address: Address


class TaskRecord(Message):
    """A task's record: its providers, who claimed it, and which of its providers were revoked or
    left the network since."""

    id: TaskId
    requester: ShortText
    providers: Annotated[list[Member], Field(max_length=MAX_TASK_PEERS * 4)]
    created: Real
    status: Annotated[str, Field(max_length=32)]
    requester_key: Annotated[str, Field(max_length=64)]
    revoked: Ids
    left: Ids


class Probe(Message):
    """Can the bootstrap dial ``address`` (the caller's own) back?"""

    address: Address


class Probed(Message):
    reachable: bool
    relay: Address


class RelayOpen(Message):
    """A relay allocation for the provider the caller registers, or for a running task it is part of."""

    provider: Id | None = None
    task: TaskId | None = None


class RelayOpened(Message):
    """The allocation's token, its public address, and the relay's own."""

    token: Token
    address: Address
    relay: Address


class RelayClose(Message):
    token: Token


class RelayClosed(Message):
    closed: bool


class ProviderProgress(Message):
    """One provider's progress, as its requester saw it."""

    state: Literal[PROGRESS_STATES] = "training"  # type: ignore[valid-type]
    iteration: Count = 0
    iterations: Count = 0
    train_loss: Real | None = None
    test_acc: Real | None = None
    evaluated_at: Count | None = None
    leader: Id | None = None


class TaskResult(Message):
    """A finished task's headline figures."""

    accuracy: Real | None = None
    perplexity: Real | None = None


class TaskProgress(Message):
    """A requester's report of its task, for the dashboard."""

    task: TaskId
    providers: Annotated[dict[Id, ProviderProgress], Field(max_length=MAX_PROGRESS)] = Field(
        default_factory=dict)
    faults: Annotated[list[ShortText], Field(max_length=MAX_FAULTS)] = Field(default_factory=list)
    result: TaskResult | None = None


class Noted(Message):
    """The report was noted; the task's providers whose keys were revoked since."""

    noted: bool
    revoked: Ids
