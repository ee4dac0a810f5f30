"""An allocation's public port: its clients, held until they send their first bytes, then each
joined to a parked agent connection and spliced.

A client connects as if it were the participant; once it has sent its first bytes (a ZeroMQ
peer sends its greeting at once), it is handed a parked agent connection, which hears ``G`` and
those bytes, and from then on the relay copies bytes both ways. Anyone can connect, so clients
are capped per allocation at each stage, per source address and in all; a full cap evicts the
connection idle longest.
"""

from __future__ import annotations

import socket
import time
from functools import partial

from meshlearn.network.channel.allocations import RelayAllocation
from meshlearn.network.channel.holdings import Conn, Holdings, idlest_splice
from meshlearn.network.channel.relaywire import GO, tune
from meshlearn.network.channel.splicer import READ, Splice, Splicer

FIRST_BYTES = 4096  # at most this much of a client's first bytes is held until it is spliced
FIRST_BYTES_TIME = 3.0  # seconds a client has to send its first bytes (ZeroMQ sends its greeting at once)
MAX_PENDING = 32  # clients per allocation that sent nothing yet: a newcomer evicts the oldest
MAX_WAITING = 32  # clients per allocation waiting for a parked connection: a newcomer evicts the oldest
CLIENT_WAIT = 10.0  # seconds a client waits for a parked agent connection
MAX_SPLICES = 48  # live splices per allocation: a new one evicts the one idle longest
MAX_SPLICES_TOTAL = 512  # live splices of the whole relay: likewise
MAX_CLIENTS_PER_ADDRESS = 16  # one address's connections to an allocation: its newcomer evicts its idlest


def alive(sock: socket.socket) -> bool:
    """Whether a parked connection is still usable (a parked agent never sends anything: EOF,
    an error or a byte all mean it is not)."""
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        pass
    return False


class PublicPorts:
    """Serves the clients of every allocation's public port in the relay's loop, and joins them
    to parked agent connections (``pair``). ``splicer`` is set when the relay starts."""

    def __init__(self, holdings: Holdings):
        self.holdings = holdings
        self.splicer: Splicer | None = None

    def connected(self, allocation: RelayAllocation, sock: socket.socket, source: str) -> None:
        """A new client of ``allocation``, from ``source``."""
        holdings = self.holdings
        holdings.sockets += 1
        holdings.counts.accepted += 1
        client = Conn(sock, source, time.monotonic(), allocation)
        client.reader = partial(self._first_bytes, client)
        if len(allocation.clients.of(source)) >= MAX_CLIENTS_PER_ADDRESS:
            holdings.evict(holdings.idlest_client(allocation.clients.of(source)), "an allocation's cap per address")
        if len(allocation.pending) >= MAX_PENDING:
            holdings.evict(holdings.oldest_silent(allocation.pending), "an allocation's cap on silent clients")
        if allocation.closed or not holdings.make_room():
            holdings.refuse(sock)
            return
        holdings.enter(client, allocation.pending)
        holdings.unproven[client] = True
        holdings.loop.watch(sock, READ, client.reader)

    def pair(self, allocation: RelayAllocation) -> None:
        """Join waiting clients, oldest first, to parked agent connections."""
        while allocation.waiting and allocation.parked:
            agent = next(iter(allocation.parked))
            del allocation.parked[agent]
            self.holdings.loop.unwatch(agent)
            if not alive(agent):
                self.holdings.close_socket(agent)
                continue
            self._make_room_for_splice(allocation)  # evicts a spliced client, never a waiting one
            self._splice(next(iter(allocation.waiting)), agent)

    def _first_bytes(self, client: Conn, mask: int) -> None:
        try:
            data = client.sock.recv(FIRST_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # it left before sending anything
            self.holdings.drop(client)
            return
        allocation = client.allocation
        self.holdings.loop.unwatch(client.sock)
        self.holdings.unproven.pop(client, None)
        if len(allocation.waiting) >= MAX_WAITING:
            self.holdings.evict(next(iter(allocation.waiting)), "an allocation's cap on waiting clients")
        client.data, client.since = data, time.monotonic()
        self.holdings.enter(client, allocation.waiting)
        self.pair(allocation)

    def _make_room_for_splice(self, allocation: RelayAllocation) -> None:
        if len(allocation.spliced) >= MAX_SPLICES:
            self.holdings.evict(idlest_splice(allocation.spliced), "an allocation's splices cap")
        if self.holdings.splices >= MAX_SPLICES_TOTAL:
            self.holdings.evict(idlest_splice(self.holdings.all_spliced()), "the relay's splices cap")

    def _splice(self, client: Conn, agent: socket.socket) -> None:
        try:
            tune(client.sock)
        except OSError:
            pass  # it is gone: the splice will find out
        self.holdings.enter(client, client.allocation.spliced)
        client.splice = self.splicer.join(client.sock, agent, partial(self._unspliced, client), GO + client.data)
        client.data = b""
        self.holdings.splices += 1
        self.holdings.counts.spliced += 1
        client.splice.start()

    def _unspliced(self, client: Conn, splice: Splice) -> None:
        allocation = client.allocation
        allocation.spliced.pop(client, None)
        client.stage = None
        allocation.clients.discard(client)
        allocation.last_used = time.monotonic()
        self.holdings.splices -= 1
        self.holdings.sockets -= 2
