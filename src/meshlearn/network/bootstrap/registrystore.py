"""Where a bootstrap's registry is kept, as the registry's rules see it: records read and written in
one atomic transaction, whatever holds them.

``Registry`` (registry.py) states every rule once, as a function of a transaction (``RegistryTx``).
A store runs such a function atomically: SQLite serializes it with ``BEGIN IMMEDIATE``
(``SqliteStore``, one bootstrap); an etcd cluster checks, as it commits, that nothing it read
changed meanwhile and runs it again if something did (``EtcdStore``, several bootstraps sharing one
registry). A function given to ``write`` may therefore run more than once: it must do nothing but
read and write through its transaction.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

from meshlearn.errors import UserInputError

T = TypeVar("T")
HISTORY_KEPT = 5000  # the registry's history keeps about this many events (older ones are dropped)


@dataclass
class ProviderInfo:
    """A provider as the registry knows it."""

    id: str
    address: str
    ram_gb: float
    cores: int
    device: str
    location: str
    status: str = "free"  # free | busy | leaving | lost (a task reported it lost: not claimed until it beats again)
    task: str | None = None
    last_seen: float = 0.0
    key: str = ""  # its public key, proven at registration; peers connect to address@key only
    reachable: bool = True  # False: its address is an allocation of a bootstrap's relay
    registered: float = 0.0  # when it first registered (kept across refreshes)
    claimed_at: float | None = None  # when a task last claimed it
    relay: str = ""  # through the relay: the bootstrap whose relay holds its allocation (its key)

    def public(self) -> dict:
        """What discovery hands out: the address carries the key the bootstrap vouches for."""
        listed = asdict(self)
        del listed["registered"], listed["claimed_at"], listed["relay"]
        return {**listed, "address": self.pinned_address, "reachable": bool(self.reachable)}

    @property
    def pinned_address(self) -> str:
        return f"{self.address}@{self.key}" if self.key else self.address


@dataclass
class TaskRecord:
    """A claimed task as the registry keeps it: who claimed it (name and key), its providers (id and
    pinned address, as they are now), when, and its status (running | done | failed)."""

    id: str
    requester: str
    providers: list[dict] = field(default_factory=list)
    created: float = 0.0
    status: str = "running"
    requester_key: str = ""
    attempt: str = ""  # the requester's name for the claim that took its providers (a claim sent again)


class RegistryView(Protocol):
    """What a transaction reads."""

    def provider(self, provider_id: str) -> ProviderInfo | None: ...

    def providers(self) -> list[ProviderInfo]: ...

    def task(self, task_id: str) -> TaskRecord | None: ...

    def tasks(self, limit: int) -> list[TaskRecord]:
        """The latest ``limit`` tasks, newest first."""

    def revoked(self) -> list[str]:
        """Every revoked key, the first revoked first."""

    def is_revoked(self, key: str) -> bool: ...

    def history(self, limit: int) -> list[dict]:
        """The latest ``limit`` events, newest first: {"at", "kind", "subject", "detail"}."""

    def left_since(self, provider_ids: list[str], since: float) -> list[str]:
        """Those of ``provider_ids`` with a "left" event at or after ``since``, sorted."""


class RegistryTx(RegistryView, Protocol):
    """What a transaction writes (seen by its own later reads, applied together or not at all)."""

    def put_provider(self, info: ProviderInfo) -> None: ...

    def delete_provider(self, provider_id: str) -> None: ...

    def put_task(self, record: TaskRecord) -> None: ...

    def revoke(self, key: str, at: float) -> None: ...

    def note(self, at: float, kind: str, subject: str, detail: str) -> None:
        """Add an event to the history."""


class RegistryStore(Protocol):
    """Runs the registry's transactions atomically against where it is kept."""

    def open(self) -> None:
        """Connect (creating what is needed); UserInputError in one line where it cannot."""

    def close(self) -> None: ...

    @property
    def is_open(self) -> bool: ...

    def describe(self) -> str:
        """Where the registry is, for logs and messages."""

    def write(self, fn: Callable[[RegistryTx], T]) -> T:
        """``fn`` applied atomically (run again, from fresh reads, where a concurrent write got in first)."""

    def read(self, fn: Callable[[RegistryView], T]) -> T:
        """``fn`` over a consistent, current view (nothing written)."""


@dataclass(frozen=True)
class EtcdLocation:
    """A registry kept in an etcd cluster: its client endpoints, and the folder of the TLS files
    (``ca.crt``, ``client.crt``, ``client.key``) where the cluster requires them."""

    endpoints: tuple[str, ...]
    tls: Path | None = None


def parse_registry(text: str, tls: str = "") -> EtcdLocation:
    """``--registry`` parsed once: ``etcd://HOST:PORT[,HOST:PORT...]`` (https where ``tls`` names the
    folder of the cluster's certificates)."""
    if not text.startswith("etcd://"):
        raise UserInputError(f"--registry {text!r} is not etcd://HOST:PORT[,HOST:PORT...]: give the cluster's "
                             "client endpoints, or leave it out for the SQLite file --state")
    scheme = "https" if tls else "http"
    endpoints = []
    for part in text[len("etcd://"):].split(","):
        host, sep, port = part.strip().rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise UserInputError(f"--registry {text!r}: {part!r} is not HOST:PORT (say etcd://10.0.0.1:2379,"
                                 "10.0.0.2:2379,10.0.0.3:2379)")
        endpoints.append(f"{scheme}://{host}:{port}")
    return EtcdLocation(tuple(endpoints), Path(tls) if tls else None)
