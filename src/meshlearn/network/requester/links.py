"""How a requester speaks to the network: every request it sends the bootstrap goes through
``BootstrapLink``, every one it sends a provider of its task through ``ProviderLink``. Each is a
typed call (``protocol.serving.ask``): a request model of its declaration (``protocol.rpcs``) goes,
its reply model comes back (BadMessage where the reply does not fit it)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Protocol

from meshlearn.errors import (
    NetworkError,
    RemoteError,
    TaskFailed,
    Unreachable,
    UserInputError,
)
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import (
    Probe,
    Probed,
    ProviderRecord,
    Release,
    TaskName,
    TaskProgress,
    TaskRecord,
)
from meshlearn.network.protocol.bootstraps import Bootstraps
from meshlearn.network.protocol.message import Empty, Message
from meshlearn.network.protocol.providerapi import (
    Assign,
    Join,
    PunchPorts,
    ResultMetrics,
    RunStatus,
    Start,
)
from meshlearn.network.protocol.serving import ask, ask_with_blobs
from meshlearn.network.task.spec import Peer, TaskSpec

log = logging.getLogger(__name__)
BOOTSTRAP_TIMEOUT = 10.0  # seconds a claim, a discover or a relay request may take at the bootstrap
PROGRESS_TIMEOUT = 3.0  # seconds a progress report may take (the task goes on without it)
RECORD_TIMEOUT = 5.0  # seconds the bootstrap's record of the task, or its release, may take
PROBE_TIMEOUT = 15.0  # seconds the bootstrap may take to dial the requester's data server back
PROVIDER_TIMEOUT = 10.0  # seconds a provider's answer may take, unless the caller says otherwise
CANCEL_TIMEOUT = 3.0  # seconds a provider may take to drop the task (it answers once its run stopped)
PING_TIMEOUT = 2.0  # seconds a ping may take: one that takes longer counts as no answer
RESULT_BYTES = 1 << 30  # the largest answer a provider may send (a task's result holds its model)


class Reachable(Protocol):
    """A provider as the requester reaches it: a claimed one (``ProviderRecord``), one of a task's
    spec (``Peer``) or of the bootstrap's record of a task (``Member``)."""

    @property
    def id(self) -> str: ...

    @property
    def address(self) -> str: ...


def sender_of(task_id: str) -> str:
    """The name a requester's requests for task ``task_id`` go under."""
    return f"requester-{task_id}"


class BootstrapLink:
    """The requester's line to the network's bootstraps (``address``: one, or several comma-separated:
    any of them answers, ``Bootstraps``), for task ``task_id``."""

    def __init__(self, address: str, secret: bytes, task_id: str):
        self.bootstraps = Bootstraps.parse(address)
        self.secret = secret
        self.task_id = task_id
        self.sender = sender_of(task_id)

    @property
    def address(self) -> str:
        """The bootstrap asked now (``HOST:PORT@KEY``)."""
        return self.bootstraps.current

    def call(self, rpc: rpcs.Rpc, message: Message, timeout: float = BOOTSTRAP_TIMEOUT):
        """Send one request, to the next bootstrap where one does not serve it; its reply model
        (NetworkError as ``serving.ask`` raises it)."""
        return self.bootstraps.ask(rpc, message, self.secret, timeout=timeout, sender=self.sender)

    def providers(self, rpc: rpcs.Rpc, message: Message) -> list[ProviderRecord]:
        """The providers a discover, a claim or a claim.replace gives: requests the task cannot go on
        without, so an error is one line, for the user."""
        try:
            return list(self.call(rpc, message).providers)
        except Unreachable:
            raise UserInputError(f"no bootstrap answers at {self.bootstraps.text}: check --bootstrap and that it "
                                 "runs") from None
        except RemoteError as exc:
            raise TaskFailed(f"the bootstrap could not give providers: {exc}") from None

    def progress(self, body: dict) -> list[str]:
        """One progress report for the bootstrap's dashboard (``TaskProgress``'s fields but the
        task; BadMessage where they do not fit it); returns the task's providers whose keys it says
        were revoked."""
        report = TaskProgress.read({"task": self.task_id, **body}, rpcs.TASK_PROGRESS.name)
        return list(self.call(rpcs.TASK_PROGRESS, report, timeout=PROGRESS_TIMEOUT).revoked)

    def fetch_record(self, timeout: float = RECORD_TIMEOUT) -> TaskRecord:
        """The bootstrap's record of the task (NetworkError where it cannot give it)."""
        return self.call(rpcs.TASK, TaskName(task=self.task_id), timeout=timeout)

    def record(self) -> TaskRecord | None:
        """The bootstrap's record of the task (its providers, those revoked, those that left the
        network); None if it cannot say now."""
        try:
            return self.fetch_record()
        except NetworkError as exc:
            log.info("could not ask the bootstrap for the task's record: %s", exc)
            return None

    def left(self) -> list[str]:
        """The task's providers the bootstrap saw leave the network (a provider told to leave goes
        once its part ends, maybe between two of the requester's looks); empty if it cannot say."""
        record = self.record()
        return list(record.left) if record is not None else []

    def revoked(self) -> list[str]:
        """The task's providers whose keys the bootstrap revoked (empty if it cannot say now)."""
        record = self.record()
        return list(record.revoked) if record is not None else []

    def probe(self, address: str) -> Probed:
        """Whether the bootstrap can dial ``address`` (the requester's data server)."""
        return self.call(rpcs.PROBE, Probe(address=address), timeout=PROBE_TIMEOUT)

    def release(self, status: str, lost: list[str]) -> None:
        """Tell the bootstrap the task ended (``status``) and which providers it lost; a warning if it cannot hear."""
        try:
            self.call(rpcs.RELEASE, Release(task=self.task_id, status=status, lost=lost), timeout=RECORD_TIMEOUT)
        except NetworkError as exc:
            log.warning("could not tell the bootstrap that task %s ended: %s", self.task_id, exc)


class ProviderLink:
    """The requester's line to the providers of task ``task_id``."""

    def __init__(self, secret: bytes, task_id: str):
        self.secret = secret
        self.task_id = task_id
        self.sender = sender_of(task_id)

    def call(self, peer: Reachable, rpc: rpcs.Rpc, message: Message, timeout: float = PROVIDER_TIMEOUT):
        """Send ``peer`` one request about the task; its reply model (NetworkError as ``serving.ask`` raises it)."""
        return ask(peer.address, rpc, message, self.secret, timeout=timeout, sender=self.sender,
                   max_bytes=RESULT_BYTES)

    def assign(self, peer: Reachable, spec: TaskSpec, key: str, timeout: float) -> RunStatus:
        """Give ``peer`` its part of the task: ``spec``, and ``key``, the one its engines prove."""
        return self.call(peer, rpcs.TASK_ASSIGN, Assign(task=self.task_id, spec=spec, key=key), timeout=timeout)

    def status(self, peer: Reachable, timeout: float = PROVIDER_TIMEOUT) -> RunStatus:
        """Where ``peer``'s part of the task stands."""
        return self.call(peer, rpcs.TASK_STATUS, TaskName(task=self.task_id), timeout=timeout)

    def start(self, peer: Reachable, engines: dict[str, str], joins_at: int | None = None,
              punch: dict[str, PunchPorts] | None = None) -> RunStatus:
        """Tell ``peer`` to start training with the engines at ``engines`` (by index; ``joins_at``:
        the round a newcomer joins a D-PSGD task at; ``punch``: the providers' punching ports)."""
        return self.call(peer, rpcs.TASK_START, Start(task=self.task_id, engines=engines, joins_at=joins_at,
                                                      punch=punch or {}))

    def join(self, peer: Reachable, newcomer: Peer, engine: str, at: int | None, withdraw: bool = False) -> RunStatus:
        """Tell ``peer`` to take ``newcomer`` (its engine at ``engine``) into the running task at
        round ``at``, or (``withdraw``) to go on without it."""
        return self.call(peer, rpcs.TASK_JOIN, Join(task=self.task_id, peer=newcomer, engine=engine, at=at,
                                                    withdraw=withdraw))

    def results(self, peer: Reachable, timeout: float) -> tuple[ResultMetrics, list]:
        """``peer``'s result of the task: its metrics and settings, and the model (the one blob)."""
        return ask_with_blobs(peer.address, rpcs.TASK_RESULTS, TaskName(task=self.task_id), self.secret,
                              timeout=timeout, sender=self.sender, max_bytes=RESULT_BYTES)

    def ping(self, peer: Reachable) -> None:
        """One round trip to ``peer`` (NetworkError if it does not answer in ``PING_TIMEOUT``)."""
        ask(peer.address, rpcs.PROVIDER_PING, Empty(), self.secret, timeout=PING_TIMEOUT, sender=self.sender)

    def cancel(self, peers: Iterable[Reachable]) -> None:
        """Tell every provider of ``peers`` to drop the task (best effort), so none stays busy with it."""
        for peer in peers:
            try:
                self.call(peer, rpcs.TASK_CANCEL, TaskName(task=self.task_id), timeout=CANCEL_TIMEOUT)
            except NetworkError:
                pass
