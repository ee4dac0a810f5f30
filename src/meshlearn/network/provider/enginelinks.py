"""A task run's engine as its peers reach it, and its links to them through NATs.

Where the engine is announced: this machine's address, the relay's allocation (behind NAT), or,
for a UDP engine behind NAT, the NAT's mapping of its socket (``NatSide``; its HELLOs punch the
paths). For TCP, the ports its links are punched from (``PunchPorts``, told to the requester with
the run's status and to every provider with the start), the links routed through ``LinkPaths``,
and each link's path for the run's progress.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshlearn.network.protocol.providerapi import PunchPorts
from meshlearn.network.provider.linkpaths import ANNOUNCED, DIRECT, PUNCHED, EngineRoutes, LinkPaths
from meshlearn.network.provider.natside import LinkSide, public_ports

if TYPE_CHECKING:
    from meshlearn.network.provider.taskrun import ProviderContext


class EngineLinks:
    """One task run's engine address and links (``expose`` once bound, ``route`` at the start,
    ``report`` any time, ``close`` at the end)."""

    def __init__(self, ctx: ProviderContext, task_id: str, index: int, budget: float | None = None):
        self.ctx = ctx
        self.task_id = task_id
        self.index = index  # this provider's in the task
        self.budget = budget  # seconds the engine waits for its neighbours' handshakes: punches end well within
        self.address = ""  # scheme://HOST:PORT where peers reach the engine ("": none, a task of one)
        self._engine_port = 0
        self._side = LinkSide(None)  # its punching ports, the sockets that keep them, its QUIC sockets
        self._unexpose: Callable[[], None] = lambda: None
        self._paths: LinkPaths | None = None
        self._report: Callable[[], dict] = dict
        self._routed: dict[int, str] | None = None  # the book the start's routing gave (a start sent again gets it)
        self._closed = False
        self._lock = threading.Lock()  # route, close: a start and the run's end come from different threads

    @property
    def punch(self) -> PunchPorts | None:
        """Where this provider's TCP links can be punched (None: they cannot)."""
        return self._side.ports

    def expose(self, bound: str, datagram_socket: Callable[[], socket.socket], peers: int) -> None:
        """Say where peers reach the engine bound at ``bound`` (``scheme://HOST:PORT``; the UDP
        engine's socket from ``datagram_socket``; ``peers``: the task's providers), and learn the
        ports its TCP links are punched from."""
        ctx = self.ctx
        scheme, _, where = bound.partition("://")
        port = where.rpartition(":")[2]
        if not port.isdigit():
            return
        if scheme == "udp":  # its peers learn whether it is behind NAT (its links then say punched)
            if ctx.relayed:
                self.address = f"udp://{ctx.nat.udp_engine_address(datagram_socket())}"
                self._side = LinkSide(PunchPorts(behind_nat=True))
                return
            self._side = LinkSide(PunchPorts())
        reached, self._unexpose = ctx.reach(int(port), self.task_id)
        self.address = f"{scheme}://{reached}"
        if scheme == "tcp":
            self._engine_port = int(port)
            others = [i for i in range(peers) if i != self.index]
            self._side = ctx.nat.punch_ports(ctx.host, others) if ctx.nat is not None \
                else public_ports(ctx.host, ctx.public_host or ctx.host, others)

    def route(self, book: dict[int, str], ids: dict[int, str], punches: dict[int, PunchPorts],
              engine_meets: bool = False) -> dict[int, str]:
        """The book the engine dials (routed once: a start sent again gets the first one's book;
        after ``close``, ``book`` as it is, and nothing is started; ``engine_meets``: whether the
        engine takes punched paths over, ``Endpoint.meets``)."""
        with self._lock:
            if self._closed:
                return book
            if self._routed is None:
                self._routed = self._route(book, ids, punches, engine_meets)
            return self._routed

    def _route(self, book: dict[int, str], ids: dict[int, str], punches: dict[int, PunchPorts],
               engine_meets: bool) -> dict[int, str]:
        udp = self.address.startswith("udp://")  # HELLOs punch the path; nothing goes through the relay
        if udp or not self.ctx.relayed and not any(p.behind_nat for p in punches.values()):
            behind = udp and self.ctx.relayed
            report = {ids[j]: {"path": ANNOUNCED if j not in punches and not behind else
                               PUNCHED if behind or udp and punches[j].behind_nat else DIRECT,
                               "relay_bytes": 0} for j in book}  # the links as the start made them
            self._report = lambda: {peer: dict(link) for peer, link in report.items()}
            return book
        self._paths = LinkPaths(self.index, self.ctx.host, self._engine_port, self.punch, self.ctx.punch_memory,
                                self._side.quic, self.ctx.clock, self.budget, here=self._side.here,
                                engine_meets=engine_meets)
        routed = self._paths.route(book, ids, punches)
        self._report = self._paths.report
        return routed

    def settle(self, book: dict[int, str]) -> EngineRoutes:
        """Once the links' TCP punches ended: what the engine dials (``book``, as ``route`` gave it,
        with each punched link the engine's own to connect), meets and falls back to (``LinkPaths.settle``)."""
        paths = self._paths
        return paths.settle(book) if paths is not None else EngineRoutes(book)

    def report(self) -> dict[str, dict]:
        """Each link this provider's engine dials, by neighbour id: its path and its bytes through the relay."""
        return self._report()

    def describe(self) -> str:
        """The links that are not direct, in a few words ("home2 punched, home3 relayed: 1.2 MB
        through the relay"); "" where every link is direct."""
        report = self.report()
        crossing = {peer: link for peer, link in report.items() if link["path"] != DIRECT}
        if not crossing:
            return ""
        relayed = sum(link["relay_bytes"] for link in crossing.values())
        return ", ".join(f"{peer} {link['path']}" for peer, link in sorted(crossing.items())) \
            + (f": {relayed / 1e6:.1f} MB through the relay" if relayed else "")

    def close(self) -> None:
        """End the links' paths, give the relay allocation back, free the punching ports (once; a
        start that comes later routes nothing)."""
        with self._lock:
            self._closed = True
        if self._paths is not None:
            self._paths.close()
        self._unexpose()
        self._side.close()
