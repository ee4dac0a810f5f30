"""The bodies of the requests a provider answers, and of its replies (declared in ``rpcs``)."""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, model_validator

from meshlearn.network.protocol.message import (
    Address,
    Count,
    FreeForm,
    Id,
    Key,
    Message,
    Round,
    TaskId,
)
from meshlearn.network.task.spec import MAX_TASK_PEERS, Peer, TaskSpec


def _spec(value: Any) -> Any:
    """A task's spec from the network, validated by its own rules (``TaskSpec.parse``)."""
    return TaskSpec.parse(value) if isinstance(value, dict) else value


EngineIndex = Annotated[str, Field(pattern=r"^[0-9]{1,4}$")]  # a provider's index, as a JSON object's key
Engine = Annotated[str, Field(max_length=256)]  # a task engine's scheme://HOST:PORT ("": none yet, or alone)
RunStateName = Annotated[str, Field(max_length=16)]  # a run's state (``taskrun.RunState``)
MAX_ERROR = 1000  # characters of a failed run's error its status carries
def _unicast_ipv4(value: str) -> str:
    """An IPv4 address a peer can be reached at: written plainly (no leading zeros), neither
    unspecified, broadcast, multicast nor reserved."""
    try:
        address = ipaddress.IPv4Address(value)
    except ValueError:
        raise ValueError(f"{value!r} is no IPv4 address") from None
    if address.is_unspecified or address.is_multicast or address.is_reserved or address.is_link_local:
        raise ValueError(f"{value} is no address a peer can be reached at")
    return value


Ipv4 = Annotated[str, Field(max_length=15), AfterValidator(_unicast_ipv4)]
Port = Annotated[int, Field(ge=1, le=65535)]
Fingerprint = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]  # SHA-256, hex
MAX_QUIC_PEERS = 16  # providers a provider keeps a QUIC socket for (a larger task's unpunchable TCP links: the relay)


class PunchPorts(Message):
    """Where a provider's engine links can be punched through NATs (``channel.punch``): its public
    host as the bootstrap saw it, and the public ports of its two punching ports (``out``: its links
    to providers behind NAT; ``in``: theirs to it, only behind a NAT). A provider behind a NAT that
    maps each destination to a new port (symmetric) names no port: its links go through the relay."""

    host: Ipv4 | None = None
    out_port: Port | None = None
    in_port: Port | None = None
    behind_nat: bool = False
    # where TCP cannot be punched but UDP can: the fingerprint of the certificate its QUIC paths
    # present, and the public port of its UDP socket for the path with each provider, by index
    quic_pin: Fingerprint | None = None
    udp_ports: Annotated[dict[EngineIndex, Port], Field(max_length=MAX_QUIC_PEERS)] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _ports_have_a_host(self) -> PunchPorts:
        if self.host is None and (self.out_port or self.in_port or self.udp_ports or self.quic_pin):
            raise ValueError("punching ports name no host")
        return self

    def udp_port_for(self, index: int) -> int | None:
        """The public UDP port of this provider's QUIC socket for the path with provider ``index``."""
        return self.udp_ports.get(str(index))


class Assign(Message):
    """A provider's part of a task: the spec, and the key the task's engines prove."""

    task: TaskId
    spec: Annotated[TaskSpec, BeforeValidator(_spec)]
    key: Key


class RunStatus(Message):
    """Where a provider's part of a task stands (``TaskRun.status``)."""

    task: TaskId
    index: Count
    state: RunStateName
    error: Annotated[str, Field(max_length=MAX_ERROR)] | None = None
    engine: Engine = ""
    progress: FreeForm = Field(default_factory=dict)
    leader: Id
    results: bool
    leaving: bool = False
    punch: PunchPorts | None = None


class Start(Message):
    """Start training: each provider's engine address by index; a provider taken in mid-run joins at ``joins_at``."""

    task: TaskId
    engines: Annotated[dict[EngineIndex, Engine], Field(max_length=MAX_TASK_PEERS)]
    joins_at: Round | None = None
    punch: Annotated[dict[EngineIndex, PunchPorts], Field(max_length=MAX_TASK_PEERS)] = Field(default_factory=dict)

    def book(self) -> dict[int, str]:
        """The engines' addresses by provider index."""
        return {int(index): address for index, address in self.engines.items()}

    def punches(self) -> dict[int, PunchPorts]:
        """The providers' punching ports by index (those that have some)."""
        return {int(index): ports for index, ports in self.punch.items()}


class Join(Message):
    """Take ``peer`` into the running task at round ``at`` (its engine at ``engine``), or withdraw it."""

    task: TaskId
    peer: Peer
    engine: Address
    at: Round | None = None
    withdraw: bool = False


class ResultMetrics(Message):
    """A finished task's metrics, and its task's settings as the provider kept them (``TaskSpec``'s);
    the model travels as the one blob."""

    metrics: FreeForm
    task: FreeForm | None = None


class Cancelled(Message):
    cancelled: bool


class Push(Message):
    """A follower's final model (the blobs), its samples and updates, its last loss (None where it diverged)."""

    task: TaskId
    index: Count
    samples: Count
    updates: Count = 0
    loss: float | None = None


class PushAnswer(Message):
    """Taken, or not (this provider does not lead: the one it follows); ``results``: the result is ready."""

    accepted: bool | None = None
    leader: Count | None = None
    results: bool = False


class Provider(Message):
    """A task's provider, by index (``agg.ping``)."""

    task: TaskId
    index: Count


class Pong(Message):
    """Whether this provider holds the result, which provider it follows as leader, and its run's state."""

    results: bool
    leader: Count
    state: RunStateName | None = None


class ResultCopy(Message):
    """A copy of the leader's result: its metrics; the model travels as the one blob."""

    task: TaskId
    metrics: FreeForm


class Kept(Message):
    kept: bool


class Leaving(Message):
    """The provider leaves after ``after_task`` (None: at once)."""

    leaving: bool
    after_task: Id | None = None
