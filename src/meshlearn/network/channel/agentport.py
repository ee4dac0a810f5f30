"""The relay's agent port: each connection's first line, ``KEY`` answered with the bootstrap's
public key, ``ADDR`` with the address and port the connection came from (a peer's TCP mapping
through its NAT), ``AGENT token`` connections parked for their allocation until a client takes one.

Anyone can connect, so a connection has GREETING_TIME for its whole line, and those not past it
are capped in all and per source address (a newcomer evicts the oldest silent one).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from functools import partial

from meshlearn.network.channel.allocations import Allocations, RelayAllocation
from meshlearn.network.channel.holdings import Conn, Holdings
from meshlearn.network.channel.relaywire import (
    ADDR_REPLY,
    ADDR_REQUEST,
    AGENT_REQUEST,
    KEY_REPLY,
    KEY_REQUEST,
    LINE_MAX,
    tune,
)
from meshlearn.network.channel.splicer import READ

MAX_PARKED = 16  # parked agent connections per allocation (more are refused)
MAX_GREETING = 256  # connections not past their first line: a newcomer evicts the oldest...
MAX_GREETING_PER_ADDRESS = 32  # ... or, over this many from its address, that address's oldest


class AgentPort:
    """Serves the agent port's connections in the relay's loop: reads each one's first line,
    answers ``KEY`` and ``ADDR``, parks ``AGENT`` connections and hands each allocation to ``pair`` when one
    is parked (a waiting client may take it)."""

    def __init__(self, holdings: Holdings, allocations: Allocations, key_line: str,
                 pair: Callable[[RelayAllocation], None]):
        self.holdings = holdings
        self.allocations = allocations
        self.key_line = key_line  # the bootstrap's public key, as printed
        self.pair = pair

    def connected(self, sock: socket.socket, source: str) -> None:
        """A new connection to the agent port, from ``source``."""
        holdings = self.holdings
        holdings.sockets += 1
        holdings.counts.accepted += 1
        greeting = Conn(sock, source, time.monotonic())
        greeting.reader = partial(self._greeting_readable, greeting)
        if len(holdings.greetings) >= MAX_GREETING:
            holdings.evict(holdings.oldest_silent(holdings.greetings.all), "the agent port's greeting cap")
        if len(holdings.greetings.of(source)) >= MAX_GREETING_PER_ADDRESS:
            holdings.evict(holdings.oldest_silent(holdings.greetings.of(source)), "the agent port's cap per address")
        if not holdings.make_room():
            holdings.refuse(sock)
            return
        holdings.greetings.add(greeting)
        holdings.unproven[greeting] = True
        holdings.loop.watch(sock, READ, greeting.reader)

    def _greeting_readable(self, greeting: Conn, mask: int) -> None:
        try:
            data = greeting.sock.recv(LINE_MAX + 1 - len(greeting.data))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        greeting.data += data
        line, newline, rest = greeting.data.partition(b"\n")
        if not newline and data and len(greeting.data) <= LINE_MAX:
            return  # more to come
        self.holdings.greetings.discard(greeting)
        self.holdings.unproven.pop(greeting, None)
        words = line.split() if newline else []
        if words == [KEY_REQUEST] and self.key_line:
            self._answer_key(greeting.sock)
        elif words == [ADDR_REQUEST]:
            self._answer_address(greeting.sock)
        elif len(words) == 2 and words[0] == AGENT_REQUEST and not rest:
            self._park(greeting.sock, words[1].decode(errors="replace"))
        else:
            self.holdings.warn.warning("bad line", "relay: refused a connection that sent no KEY, ADDR or AGENT line")
            self.holdings.refuse(greeting.sock)

    def _answer_key(self, sock: socket.socket) -> None:
        try:
            sock.send(KEY_REPLY + self.key_line.encode() + b"\n")
        except OSError:
            pass
        self.holdings.close_socket(sock)

    def _answer_address(self, sock: socket.socket) -> None:
        """Tell the connection the address and port it came from, as seen here, then close it."""
        try:
            host, port = sock.getpeername()[:2]
            sock.send(ADDR_REPLY + f"{host}:{port}\n".encode())
        except OSError:
            pass
        self.holdings.close_socket(sock)

    def _park(self, sock: socket.socket, token: str) -> None:
        allocation = self.allocations.get(token)
        if allocation is None or allocation.closed:
            self.holdings.warn.warning("no allocation", "relay: refused a connection that named no allocation")
            self.holdings.refuse(sock)
            return
        if len(allocation.parked) >= MAX_PARKED:
            self.holdings.refuse(sock)
            return
        try:
            tune(sock)
        except OSError:
            self.holdings.refuse(sock)
            return
        allocation.parked[sock] = True
        allocation.last_used = time.monotonic()
        self.holdings.loop.watch(sock, READ, partial(self._parked_gone, allocation, sock))
        self.pair(allocation)

    def _parked_gone(self, allocation: RelayAllocation, sock: socket.socket, mask: int) -> None:
        """A parked connection became readable: its agent is gone (or broke the protocol)."""
        allocation.parked.pop(sock, None)
        self.holdings.close_socket(sock)
