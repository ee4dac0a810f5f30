"""The participant's side of a relay allocation: an agent that keeps connections parked at the
relay and joins each one a client takes to the participant's own server, and how a participant
asks the bootstrap for an allocation and holds it.

The agent dials out (so NAT lets its connections through), presents the allocation's token on
each one, waits for the relay's go-byte, then connects to the local server and copies bytes both
ways, all in one thread (``splicer.Loop``).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from meshlearn.errors import NetworkError
from meshlearn.network.channel.addresses import is_wildcard
from meshlearn.network.channel.agentport import MAX_PARKED
from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.envelope import field_of
from meshlearn.network.channel.publicports import MAX_SPLICES
from meshlearn.network.channel.relaywire import AGENT_REQUEST, GO, host_port, tune
from meshlearn.network.channel.splicer import (
    READ,
    Loop,
    Splice,
    Splicer,
    close_socket,
    dial,
)

log = logging.getLogger(__name__)

PARKED = 4  # agent connections an allocation keeps waiting at the relay
AGENT_MAX = MAX_SPLICES + MAX_PARKED  # relay connections an agent holds at once, parked or spliced
AGENT_PIPES = 16
REFUSALS_LOST = 5  # parked connections closed in a row before any client came: the relay forgot the token
UNREACHABLE_LOST = 5.0  # seconds in which every dial of the relay failed: its bootstrap is gone, the
# allocation with it (a network of several bootstraps re-allocates on another)


class RelayAgent:
    """This side of an allocation: keeps ``parked`` connections parked at the relay and joins each
    one a client takes to the local server at ``local`` (HOST:PORT on this machine), all in one
    thread; at most AGENT_MAX relay connections at once. ``lost`` is set when the relay keeps
    closing parked connections before any client came (it no longer knows the token: restarted,
    or the allocation was closed), or cannot be reached at all for UNREACHABLE_LOST seconds;
    the agent then stops."""

    def __init__(self, relay: str, token: str, local: str, parked: int = PARKED,
                 on_lost: Callable[[], None] | None = None):
        self.relay = host_port(relay)
        self.token = token
        self.local = host_port(local)
        self.parked = parked
        self.lost = threading.Event()
        self.on_lost = on_lost  # told once ``lost`` is set (the provider registers again at once)
        self._loop = Loop("relay-agent", on_stop=self._close_everything)
        self._splicer: Splicer | None = None
        self._sockets: set[socket.socket] = set()  # dialing, parked and joining connections
        self._splices: set[Splice] = set()
        self._parking = 0  # slots dialing, parked, or waiting to try again
        self._joining = 0  # taken by a client, dialing the local server
        self._failures = 0
        self._failing_since = 0.0  # monotonic time of the first of the failed dials in a row
        self._refusals = 0
        self._closing = False

    def start(self) -> None:
        """Start parking connections, in the agent's thread."""
        self._splicer = Splicer(self._loop, AGENT_PIPES)
        self._loop.start()
        self._loop.call_soon(self._park_more)

    def stop(self) -> None:
        """Close every connection of the agent's (back when this returns)."""
        self._loop.stop()

    # --- everything below runs in the agent's thread ---

    def _park_more(self) -> None:
        while (not self._closing and self._parking < self.parked
               and self._parking + self._joining + len(self._splices) < AGENT_MAX):
            self._parking += 1
            self._track(dial(self._loop, self.relay, self._relay_dialed))

    def _track(self, sock: socket.socket | None) -> None:
        if sock is not None:
            self._sockets.add(sock)

    def _close(self, sock: socket.socket) -> None:
        self._sockets.discard(sock)
        self._loop.unwatch(sock)
        close_socket(sock)

    def _retry_later(self, delay: float) -> None:
        """This parking slot tries again in ``delay`` seconds."""
        def retry() -> None:
            self._parking -= 1
            self._park_more()
        self._loop.call_later(delay, retry)

    def _relay_dialed(self, sock: socket.socket | None, error: OSError | None) -> None:
        if error is None:
            try:
                sock.send(AGENT_REQUEST + f" {self.token}\n".encode())
                tune(sock)
            except OSError as exc:
                error = exc
                self._close(sock)
        if error is not None:
            self._sockets.discard(sock)
            self._failures += 1
            if self._failures in (1, 10):
                log.warning("relay %s:%d cannot be reached (%s): retrying", *self.relay, error)
            self._failing_since = self._failing_since or time.monotonic()
            if time.monotonic() - self._failing_since >= UNREACHABLE_LOST:
                self._give_up(f"relay {self.relay[0]}:{self.relay[1]} cannot be reached any more")
                return
            self._retry_later(min(2.0, 0.2 * self._failures))
            return
        self._failures, self._failing_since = 0, 0.0
        self._loop.watch(sock, READ, partial(self._relay_said, sock))

    def _relay_said(self, sock: socket.socket, mask: int) -> None:
        """The relay sent the go-byte (a client took this connection) or closed it."""
        try:
            byte = sock.recv(1)
        except BlockingIOError:
            return
        except OSError:  # broken (keepalives): try again
            self._close(sock)
            self._retry_later(0.2)
            return
        if byte != GO:
            self._close(sock)
            self._refused()
            return
        self._loop.unwatch(sock)
        self._refusals = 0
        self._parking -= 1
        self._joining += 1
        self._park_more()
        self._track(dial(self._loop, self.local, partial(self._local_dialed, sock)))

    def _local_dialed(self, upstream: socket.socket, local: socket.socket | None, error: OSError | None) -> None:
        self._joining -= 1
        self._sockets.discard(upstream)
        self._sockets.discard(local)
        if error is None:
            try:
                tune(local)
            except OSError as exc:
                error = exc
                close_socket(local)
        if error is not None:
            log.debug("relay agent: the local server %s:%d cannot be reached (%s)", *self.local, error)
            close_socket(upstream)
            self._park_more()
            return
        splice = self._splicer.join(upstream, local, self._unspliced)
        self._splices.add(splice)
        splice.start()

    def _unspliced(self, splice: Splice) -> None:
        self._splices.discard(splice)
        self._park_more()

    def _refused(self) -> None:
        self._refusals += 1
        if self._refusals < REFUSALS_LOST:
            self._retry_later(min(5.0, 0.2 * 2 ** min(self._refusals, 5)))
            return
        self._give_up(f"relay {self.relay[0]}:{self.relay[1]} no longer knows this allocation (restarted, or "
                      "closed it)")

    def _give_up(self, why: str) -> None:
        """The allocation is gone: say so (``lost``), and stop."""
        log.warning("%s", why)
        self.lost.set()
        if self.on_lost is not None:
            self.on_lost()
        self._loop.stop()

    def _close_everything(self) -> None:
        self._closing = True
        for splice in list(self._splices):
            splice.close()
        for sock in list(self._sockets):
            self._close(sock)
        if self._splicer is not None:
            self._splicer.close()


@dataclass
class Allocation:
    """A relay allocation held by this participant: its public address, the agent serving it,
    and ``close`` (stops the agent and gives the allocation back)."""

    address: str
    agent: RelayAgent
    close: Callable[[], None]


def hold_allocation(ask: Callable[[str, dict], dict], host: str, port: int, holder: Holder,
                    on_lost: Callable[[], None] | None = None) -> Allocation:
    """Ask the bootstrap (``ask(kind, body) -> reply body``) for an allocation serving ``holder``
    (this provider's registration, or a task this participant is part of), and serve it with an
    agent for this machine's ``port`` (on ``host``, loopback if that is a wildcard); ``on_lost``
    is told when the agent finds the allocation gone."""
    reply = ask("relay.open", {holder.kind: holder.name})
    token = field_of(reply, "token", str, max_len=64)
    address, relay = field_of(reply, "address", str, max_len=256), field_of(reply, "relay", str, max_len=256)
    agent = RelayAgent(relay, token, f"{'127.0.0.1' if is_wildcard(host) else host}:{port}", on_lost=on_lost)
    agent.start()

    def close() -> None:
        agent.stop()
        try:
            ask("relay.close", {"token": token})
        except NetworkError:
            pass  # the relay closes it on its own once nobody serves it
    return Allocation(address, agent, close)
