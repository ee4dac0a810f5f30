"""The transport interface every way of moving messages between nodes implements."""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field, fields
from typing import ClassVar, Iterable, Mapping

from meshlearn.errors import TransportError, WireError
from meshlearn.sparselog import SparseLog
from meshlearn.threads import GuardedThread
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import ReplayedMessage, ReplayWindow

log = logging.getLogger(__name__)

SILENT_AFTER = 3  # deadlines a peer misses in a row before gather stops waiting for it
# Messages (or UDP partial models) kept per sender for iterations not yet gathered. A synchronous
# neighbour is at most an iteration or two ahead (8 leaves room for bursts); the cap bounds what a
# peer, or a stranger claiming to be one, can make a node hold. Over it the furthest is dropped.
MAX_PENDING_PER_SENDER = 8


class Receipt:
    """Tells whether a transport is done with the buffers of a message it was given."""

    @property
    def done(self) -> bool:
        return True


DONE = Receipt()


@dataclass
class TransportStats:
    """Counters a transport keeps for its node; reported in the run log."""

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    stale_dropped: int = 0
    duplicates_dropped: int = 0
    malformed_dropped: int = 0
    replay_dropped: int = 0  # sealed messages that opened but had been taken before: played again on the path
    unknown_sender_dropped: int = 0
    overflow_dropped: int = 0  # kept for a later iteration, then dropped for a newer one (cap per sender)
    send_dropped: int = 0
    gather_timeouts: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters from any thread (a plain ``+=`` is safe only from one thread per counter)."""
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + value)

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict (for JSON logs)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}


class Endpoint(ABC):
    """A node's network endpoint, whatever the exchange pattern: what the node runtime needs.

    Life cycle: ``bind()`` (returns the address others reach this node at), ``connect(peers)``,
    then the pattern's own calls, and ``close()`` (safe to call twice). Push transports
    (``Transport``) and the pull endpoint of gossip (``transport.pull.PullEndpoint``) are endpoints.
    """

    def __init__(self, node_id: int):
        self.node_id = node_id
        self.stats = TransportStats()
        self.peers: dict[int, str] = {}
        self.departed: set[int] = set()
        self.excluded: set[int] = set()  # peers shut out of the run: never taken in again (``exclude``)
        self._peers_lock = threading.Lock()  # ``peers`` is replaced whole (readers never lock), one writer at a time
        self.window = ReplayWindow()  # the sealed messages taken, per sender (endpoints with a seal)
        self._threads: list[GuardedThread] = []
        self._refusals = SparseLog(log)

    def start_thread(self, target, name: str, *args) -> GuardedThread:
        """Start one of this endpoint's background threads (its failure is raised by ``check``)."""
        thread = GuardedThread(target, f"{name}-{self.node_id}", args)
        thread.start()
        self._threads.append(thread)
        return thread

    def exclude(self, peer: int) -> None:
        """Take nothing from ``peer`` and send it nothing from now on (it was shut out of the run:
        a network task's provider whose key was revoked); it counts as departed, so nobody waits
        for it. Safe from any thread, against ``take_in`` too: an exclusion is never undone."""
        with self._peers_lock:
            self.excluded.add(peer)
            self.peers = {p: address for p, address in self.peers.items() if p != peer}
            self.departed.add(peer)

    def take_in(self, peer: int, address: str) -> bool:
        """Add a peer that joined while the run goes on (a new ``peers``, replaced whole, so readers
        need no lock); False, and nothing changes, for one shut out of the run (``exclude``)."""
        with self._peers_lock:
            if peer in self.excluded:
                return False
            self.peers = {**self.peers, peer: address}
            return True

    def drop_refused(self, error: WireError, what: str) -> None:
        """Count a received message that is refused, ``what`` it was (a replay: ``replay_dropped``;
        one that does not open or decode: ``malformed_dropped``), and log it sparsely (any thread)."""
        replayed = isinstance(error, ReplayedMessage)
        self.stats.add(**{"replay_dropped" if replayed else "malformed_dropped": 1})
        self._refusals.warning("replayed" if replayed else "malformed", "node %d: dropped %s: %s", self.node_id,
                               what, error)

    def check(self) -> None:
        """Raise ``ThreadFailed`` if a thread this endpoint depends on has died (called by the node
        between iterations, so a node never runs on unable to serve or receive)."""
        for thread in self._threads:
            thread.raise_if_failed()

    @abstractmethod
    def bind(self) -> str:
        """Open this node's endpoint; return its address."""

    meets = False  # whether ``meet`` and ``fall_back`` work: one connection to each neighbour, its ends punched ports

    def meet(self, peer: int, address: str) -> None:
        """Connect out to ``address`` to meet ``peer``'s link to this node (a path punched through
        NATs: ``TcpTransport``); other transports have no such links."""
        raise TransportError(f"{type(self).__name__} cannot meet neighbour {peer} at {address}: its links are "
                             "not punched TCP")

    def fall_back(self, peer: int, address: str, after: float) -> None:
        """Dial ``address`` instead should the link to ``peer`` not work within ``after`` seconds
        (a punched path: ``TcpTransport``); other transports have no such links."""
        raise TransportError(f"{type(self).__name__} cannot fall back to {address} for neighbour {peer}: its links "
                             "are not punched TCP")

    @abstractmethod
    def connect(self, peers: Mapping[int, str]) -> None:
        """Get ready to talk to the peers (id -> address)."""

    def extra_stats(self) -> dict[str, int]:
        """Endpoint-specific counters for the run log (UDP: datagrams, lost chunks, drops)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Release the endpoint (push transports say BYE first)."""


class Unconnected(Endpoint):
    """The endpoint of a node that exchanges nothing itself (local training, or models moved by a
    service above the engine, as leader aggregation does)."""

    def bind(self) -> str:
        return ""

    def connect(self, peers: Mapping[int, str]) -> None:
        self.peers = dict(peers)

    def close(self) -> None:
        pass


class Transport(Endpoint):
    """Pushes messages between one node and its neighbours.

    ``connect(peers)`` completes a HELLO handshake with every neighbour, raising TransportError
    naming the ones that never answer; then ``send``/``broadcast``/``recv``/``gather``; ``close()``
    says BYE. A transport says what it is, so algorithms never ask for its name: ``lossy``
    (models may arrive with chunks missing, ``msg.chunks`` says which) and ``gather_timeout``
    (how long ``gather`` waits by default).
    """

    lossy: ClassVar[bool] = False

    def __init__(self, node_id: int):
        super().__init__(node_id)
        self._pending: dict[int, dict[int, Message]] = {}  # iteration -> sender -> message kept for it
        self.silent: set[int] = set()  # peers not waited for until heard again (see gather)
        self._missed: dict[int, int] = {}  # deadlines missed in a row, by peer

    @property
    @abstractmethod
    def gather_timeout(self) -> float:
        """Seconds ``gather`` waits for the neighbours' models unless told otherwise."""

    @abstractmethod
    def connect(self, peers: Mapping[int, str]) -> None:
        """Connect to the neighbours (id -> address) and complete the HELLO handshake."""

    def add_peer(self, peer: int, address: str) -> None:
        """A neighbour that joined while the run goes on (safe from any thread; the transports that
        can, take it in before their next send or receive); the others refuse (TransportError)."""
        raise TransportError(f"the {type(self).__name__} takes in no neighbours while it runs")

    @abstractmethod
    def send(self, peer: int, msg: Message) -> None:
        """Send one message to a neighbour without blocking on it; a failure is counted."""

    def broadcast(self, peers: Iterable[int], msg: Message) -> "Receipt":
        """Send one message to several neighbours (implementations encode it once).

        The receipt's ``done`` turns true once the transport no longer reads the message's
        tensors, so their memory may be reused.
        """
        for peer in peers:
            self.send(peer, msg)
        return DONE

    @abstractmethod
    def recv(self, timeout: float) -> Message | None:
        """The next valid message from a neighbour, or None after ``timeout`` seconds."""

    def recycle(self, messages: Iterable[Message]) -> None:
        """Hand back gathered messages whose tensors the caller no longer reads (buffer reuse)."""

    def gather(self, iteration: int, peers: Iterable[int], timeout: float | None = None) -> dict[int, Message]:
        """Collect the MODEL message of each peer for ``iteration``.

        Returns as soon as every live peer's message is in, or after ``timeout`` seconds
        (default ``gather_timeout``) with what arrived (a timeout is counted, not raised).
        Messages for later iterations are kept for later calls; ones for earlier iterations are
        dropped and counted as stale. A peer that missed ``SILENT_AFTER`` deadlines in a row (a
        dead process says no BYE) is not waited for until it is heard again, so a dead neighbour
        costs a few timeouts, not one per iteration.
        """
        timeout = self.gather_timeout if timeout is None else timeout
        wanted = set(peers)
        got: dict[int, Message] = {}
        for sender in list(self._pending.get(iteration, {})):
            if sender in wanted:
                got[sender] = self._pending[iteration].pop(sender)
        self._pending.pop(iteration, None)
        for old in [it for it in self._pending if it < iteration]:
            self.stats.stale_dropped += len(self._pending.pop(old))
        deadline = time.monotonic() + timeout
        listen = bool(wanted & self.silent)  # read what silent peers sent, even with no one to wait for
        while True:
            waiting = wanted - got.keys() - self.finished() - self.silent
            if not waiting and not listen:
                break
            remaining = deadline - time.monotonic() if waiting else 0.0
            if waiting and remaining <= 0:
                self.stats.gather_timeouts += 1
                break
            msg = self.recv(max(0.0, remaining))  # with no one to wait for: what has already come
            if msg is None:
                if waiting:
                    continue
                break
            if msg.kind != Kind.MODEL:
                continue
            self.silent.discard(msg.sender)  # heard again: waited for from now on
            self._missed.pop(msg.sender, None)
            if msg.iteration < iteration:
                self.stats.stale_dropped += 1
            elif msg.iteration > iteration:
                self._keep(msg)
            elif msg.sender in got:
                self.stats.duplicates_dropped += 1
            elif msg.sender in wanted:
                got[msg.sender] = msg
        for peer in wanted - got.keys() - self.departed:
            self._missed[peer] = self._missed.get(peer, 0) + 1
            if self._missed[peer] >= SILENT_AFTER:
                self.silent.add(peer)
        for peer in got:
            self._missed.pop(peer, None)
        return got

    def finished(self) -> set[int]:
        """The neighbours nothing more is to come from: those that said goodbye (less any a transport
        still awaits a message from, sent again after the goodbye: see ``tcp``)."""
        return self.departed

    def _keep(self, msg: Message) -> None:
        slot = self._pending.get(msg.iteration, {})
        if msg.sender in slot:
            self.stats.duplicates_dropped += 1
        else:
            kept = [it for it, senders in self._pending.items() if msg.sender in senders]
            if len(kept) >= MAX_PENDING_PER_SENDER:  # the furthest iteration is needed last: drop it
                self.stats.overflow_dropped += 1
                furthest = max(kept)
                if furthest < msg.iteration:
                    return
                del self._pending[furthest][msg.sender]
                if not self._pending[furthest]:
                    del self._pending[furthest]
        slot[msg.sender] = msg
        self._pending[msg.iteration] = slot
