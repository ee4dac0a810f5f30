"""Punching a TCP path without namespaces: the retry rule with a fake clock and injected connects,
a real simultaneous open between two sockets on loopback, and a task's link fronts choosing the
punched path or the relay (tests/test_nat_punch.py does the same through real NATs)."""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from meshlearn.clock import FakeClock
from meshlearn.network.channel.punch import (
    ATTEMPT_TIME,
    PUNCH_DATAGRAM,
    REFUSED_PAUSE,
    UDP_EVERY,
    PunchMemory,
    PunchResult,
    punch_socket,
    punch_tcp,
    punch_udp,
)
from meshlearn.network.protocol.providerapi import PunchPorts
from meshlearn.network.provider.linkpaths import LinkPaths
from meshlearn.network.provider.natside import QuicSockets


class SteppingClock(FakeClock):
    """A fake clock that a sleep moves forward at once (the punch loop's pauses cost no real time)."""

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_refused_punch_tries_again_after_a_pause_until_its_deadline():
    clock = SteppingClock()
    calls = []

    def refused(local, peer, timeout):
        calls.append(clock.monotonic())
        raise ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    result = punch_tcp(("127.0.0.1", 1), ("127.0.0.1", 2), clock.monotonic() + 1.0, clock, connect=refused)
    assert result.sock is None and result.why == "connection refused"
    assert result.tries == len(calls) == round(1.0 / REFUSED_PAUSE)
    assert all(b - a == pytest.approx(REFUSED_PAUSE) for a, b in zip(calls, calls[1:]))


def test_a_timed_out_try_is_followed_at_once_and_the_first_connection_is_kept():
    clock = SteppingClock()
    a, b = socket.socketpair()
    outcomes = [TimeoutError(), TimeoutError(), a]
    timeouts = []

    def connect(local, peer, timeout):
        timeouts.append(timeout)
        clock.advance(timeout if isinstance(outcomes[0], TimeoutError) else 0)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    result = punch_tcp(("127.0.0.1", 1), ("127.0.0.1", 2), clock.monotonic() + 2 * ATTEMPT_TIME + 0.5, clock,
                       connect=connect)
    assert result.sock is a and result.tries == 3
    assert timeouts == [ATTEMPT_TIME, ATTEMPT_TIME, pytest.approx(0.5)]  # a try waits no longer than what is left
    a.close()
    b.close()


def test_an_error_that_is_not_about_timing_ends_the_punch_at_once():
    clock = SteppingClock()

    def denied(local, peer, timeout):
        raise PermissionError(errno.EACCES, "Permission denied")
    result = punch_tcp(("127.0.0.1", 1), ("127.0.0.1", 2), clock.monotonic() + 10.0, clock, connect=denied)
    assert result.sock is None and result.tries == 1 and result.why == "permission denied"


def test_a_cancelled_punch_stops():
    cancelled = threading.Event()
    cancelled.set()
    result = punch_tcp(("127.0.0.1", 1), ("127.0.0.1", 2), 1e12, SteppingClock(), cancelled=cancelled)
    assert result.sock is None and result.tries == 0


def test_a_failed_punch_is_remembered_until_it_is_worth_trying_again():
    clock = FakeClock()
    memory = PunchMemory(clock, retry_after=60.0)
    assert memory.worth_trying("p1")
    memory.failed("p1")
    assert not memory.worth_trying("p1") and memory.worth_trying("p2")
    clock.advance(59.0)
    assert not memory.worth_trying("p1")
    clock.advance(1.0)
    assert memory.worth_trying("p1")
    memory.failed("p1")
    memory.worked("p1")
    assert memory.worth_trying("p1")


# ---- link fronts on loopback -------------------------------------------------------------------


class Echo:
    """A TCP server answering every chunk with ``tag`` + the chunk: stands for an engine, or a relay."""

    def __init__(self, tag: bytes):
        self.tag = tag
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.threads = [threading.Thread(target=self._serve, daemon=True)]
        self.threads[0].start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(self.tag + data)

    def close(self):
        self.listener.close()


def ask(address: str, payload: bytes) -> bytes:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(payload)
        return sock.recv(65536)


@pytest.fixture
def sides():
    """Two providers 'behind NAT' on loopback: each one's engine (an Echo), its held punching
    ports, its LinkPaths; and a relay that answers for either."""
    made, closers = {}, []
    relay = Echo(b"relay:")
    closers.append(relay.close)
    for name in ("a", "b"):
        engine = Echo(f"{name}-engine:".encode())
        held = [punch_socket("127.0.0.1", 0), punch_socket("127.0.0.1", 0)]
        ports = PunchPorts(host="127.0.0.1", out_port=held[0].getsockname()[1], in_port=held[1].getsockname()[1],
                           behind_nat=True)
        made[name] = {"engine": engine, "ports": ports, "memory": PunchMemory(), "index": "ab".index(name)}
        closers.extend([engine.close, *(sock.close for sock in held)])
    made["relay"] = f"tcp://127.0.0.1:{relay.port}"
    yield made
    for close in closers:
        close()


class Rendezvous:
    """Stands for two NATs a punch crosses: the two ends of one link's punch (from A's out port to
    B's in port, and from B's in port to A's out port) get the two ends of one TCP connection,
    once ``gate`` is open."""

    def __init__(self):
        self.lock = threading.Lock()
        self.ends: dict[frozenset, socket.socket] = {}
        self.made: list[socket.socket] = []
        self.gate = threading.Event()
        self.gate.set()

    def punch(self, local, peer, deadline, clock, cancelled=None):
        self.gate.wait(30)
        key = frozenset({local[1], peer[1]})
        with self.lock:
            if key in self.ends:
                return PunchResult(self.ends.pop(key), 1)
            with socket.create_server(("127.0.0.1", 0)) as listener:
                mine = socket.create_connection(listener.getsockname())
                self.ends[key], _ = listener.accept()
            self.made += [mine, self.ends[key]]
            return PunchResult(mine, 1)


def never_answered(local, peer, deadline, clock, cancelled=None):
    """A punch towards a peer that never punches back (its NAT drops every SYN): fails at its deadline."""
    return PunchResult(None, 1, "timed out")


def paths_of(side, mine="own", punch=None, clock=None, engine_meets=True):
    return LinkPaths(side["index"], "127.0.0.1", side["engine"].port, side["ports"] if mine == "own" else mine, side["memory"],
                     punch=punch or never_answered, engine_meets=engine_meets, **({"clock": clock} if clock else {}))


def settle_both(a, b, book_a, book_b):
    """Each side's ``settle``, at once (as each provider's run does once started)."""
    settled = {}
    threads = [threading.Thread(target=lambda: settled.__setitem__("a", a.settle(book_a))),
               threading.Thread(target=lambda: settled.__setitem__("b", b.settle(book_b)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return settled["a"], settled["b"]


def test_a_link_punched_both_ways_and_confirmed_is_the_engines_own_with_its_front_to_fall_back_on(sides):
    rendezvous = Rendezvous()
    a, b = paths_of(sides["a"], punch=rendezvous.punch), paths_of(sides["b"], punch=rendezvous.punch)
    try:
        ids = {0: "a", 1: "b"}
        pa, pb = sides["a"]["ports"], sides["b"]["ports"]
        book_a = a.route({1: sides["relay"]}, ids, {1: pb})
        book_b = b.route({0: sides["relay"]}, ids, {0: pa})
        routes_a, routes_b = settle_both(a, b, book_a, book_b)
        # a's engine dials from a's out port to b's in port, b's ROUTER meets it from there (and back)
        assert routes_a.book == {1: f"tcp://127.0.0.1:{pa.out_port};127.0.0.1:{pb.in_port}"}
        assert routes_b.meets == {0: f"tcp://127.0.0.1:{pb.in_port};127.0.0.1:{pa.out_port}"}
        assert routes_b.book == {0: f"tcp://127.0.0.1:{pb.out_port};127.0.0.1:{pa.in_port}"}
        assert routes_a.meets == {1: f"tcp://127.0.0.1:{pa.in_port};127.0.0.1:{pb.out_port}"}
        assert routes_a.fallbacks == book_a and routes_b.fallbacks == book_b  # the fronts, should the engines not meet
        assert 0 < routes_a.fallback_after <= a.punch_time
        assert len(rendezvous.made) == 4 and all(sock.fileno() == -1 for sock in rendezvous.made)  # reset, ports free
        assert a.report() == {"b": {"path": "punched", "relay_bytes": 0}}
        assert b.report() == {"a": {"path": "punched", "relay_bytes": 0}}
        assert ask(book_a[1], b"hello") == b"relay:hello"  # the front, dialed as the fallback: the relay carries it
        assert a.report()["b"]["path"] == "relayed"
    finally:
        a.close()
        b.close()


def test_a_punch_the_other_end_does_not_confirm_is_not_the_engines_and_is_remembered_as_failed(sides):
    def stranger(local, peer, deadline, clock, cancelled=None):  # a listener that answers the SYN, says nothing
        with socket.create_server(("127.0.0.1", 0)) as listener:
            mine = socket.create_connection(listener.getsockname())
            stranger.ends.append(listener.accept()[0])
        return PunchResult(mine, 1)
    stranger.ends = []
    a = paths_of(sides["a"], punch=stranger)
    try:
        book = a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})
        routes = a.settle(book)
        assert routes.book == book and routes.meets == {} and routes.fallbacks == {}
        assert ask(book[1], b"hello") == b"relay:hello" and a.report()["b"]["path"] == "relayed"
        assert not sides["a"]["memory"].worth_trying("b", "tcp")
    finally:
        a.close()
        for end in stranger.ends:
            end.close()


def test_an_engine_that_connects_once_per_thread_keeps_its_front_and_the_punched_connection_goes_through_it(sides):
    rendezvous = Rendezvous()
    a, b = (paths_of(sides[name], punch=rendezvous.punch, engine_meets=False) for name in ("a", "b"))
    try:
        ids = {0: "a", 1: "b"}
        book_a = a.route({1: sides["relay"]}, ids, {1: sides["b"]["ports"]})
        book_b = b.route({0: sides["relay"]}, ids, {0: sides["a"]["ports"]})
        routes_a, routes_b = settle_both(a, b, book_a, book_b)
        assert (routes_a.book, routes_b.book, routes_a.meets, routes_b.fallbacks) == (book_a, book_b, {}, {})
        assert ask(book_a[1], b"hello") == b"b-engine:hello"
        assert ask(book_b[0], b"hello") == b"a-engine:hello"
        assert a.report() == {"b": {"path": "punched", "relay_bytes": 0}}
    finally:
        a.close()
        b.close()


def test_a_punch_confirmed_after_the_engine_got_its_book_leaves_the_link_to_the_front(sides):
    rendezvous, clock, settled = Rendezvous(), FakeClock(), threading.Event()
    rendezvous.gate.clear()  # the punches end only after both engines got their books
    a, b = (paths_of(sides[name], punch=rendezvous.punch, clock=clock) for name in ("a", "b"))

    def run_clock():  # settle's wait for the punches runs out, however late each side reads the clock
        while not settled.is_set():
            clock.advance(60.0)
            settled.wait(0.05)
    threading.Thread(target=run_clock, daemon=True).start()
    try:
        ids = {0: "a", 1: "b"}
        book_a = a.route({1: sides["relay"]}, ids, {1: sides["b"]["ports"]})
        book_b = b.route({0: sides["relay"]}, ids, {0: sides["a"]["ports"]})
        routes_a, routes_b = settle_both(a, b, book_a, book_b)
        settled.set()
        assert (routes_a.book, routes_b.book, routes_a.meets, routes_b.meets) == (book_a, book_b, {}, {})
        rendezvous.gate.set()
        assert ask(book_a[1], b"hello") == b"relay:hello"  # parked until the punch ended, then the relay
        assert a.report() == {"b": {"path": "relayed", "relay_bytes": len(b"hello") + len(b"relay:hello")}}
    finally:
        settled.set()
        rendezvous.gate.set()
        a.close()
        b.close()


def test_a_provider_that_cannot_punch_reaches_its_neighbour_through_the_relay_and_counts_it(sides):
    a = paths_of(sides["a"], mine=None)  # behind a symmetric NAT: no punching ports
    try:
        book = a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})
        assert ask(book[1], b"hello") == b"relay:hello"
        a.close()
        assert a.report() == {"b": {"path": "relayed", "relay_bytes": len(b"hello") + len(b"relay:hello")}}
    finally:
        a.close()


def test_a_punch_the_neighbour_never_answers_falls_back_to_the_relay_and_is_remembered(sides):
    a = paths_of(sides["a"])  # b never punches back
    try:
        book = a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})
        assert ask(book[1], b"hello") == b"relay:hello"
        assert a.report()["b"]["path"] == "relayed"
        assert not sides["a"]["memory"].worth_trying("b")
    finally:
        a.close()


def test_a_neighbour_that_can_be_dialed_is_dialed_directly(sides):
    a = paths_of(sides["a"])
    try:
        open_ports = PunchPorts(host="127.0.0.1", out_port=sides["b"]["ports"].out_port)
        book = a.route({1: "tcp://127.0.0.1:9"}, {0: "a", 1: "b"}, {1: open_ports})
        assert book == {1: "tcp://127.0.0.1:9"}
        assert a.report() == {"b": {"path": "direct", "relay_bytes": 0}}
    finally:
        a.close()


def test_the_result_line_says_which_links_were_punched_or_relayed_and_skips_what_does_not_fit():
    from meshlearn.network.requester.results import links_summary

    links = {"a": {"b": {"path": "punched", "relay_bytes": 0}, "c": {"path": "relayed", "relay_bytes": 3_200_000}},
             "b": {"a": {"path": "punched", "relay_bytes": 0}, "c": "nonsense"}, "c": ["not", "a", "mapping"]}
    assert links_summary(links) == "  links: 2 punched, 1 relayed (3.2 MB through the relay)"
    assert links_summary({"a": {"b": {"path": "direct", "relay_bytes": 0}}}) == ""
    assert links_summary(None) == "" and links_summary("text") == ""


# ---- UDP punching and the QUIC path ------------------------------------------------------------


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock


def test_two_sockets_punching_udp_towards_each_other_both_hear_and_the_peers_quic_is_left_for_quic():
    import time

    a, b = udp_socket(), udp_socket()
    try:
        b.sendto(b"\xc0 a QUIC Initial", a.getsockname())  # b's QUIC started already: a must not eat it
        results = {}
        threads = [threading.Thread(target=lambda: results.update(
            a=punch_udp(a, b.getsockname(), time.monotonic() + 10))),
            threading.Thread(target=lambda: results.update(b=punch_udp(b, a.getsockname(), time.monotonic() + 10)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(20)
        assert results == {"a": True, "b": True}
        assert a.recvfrom(64, socket.MSG_DONTWAIT)[0] == b"\xc0 a QUIC Initial"
    finally:
        a.close()
        b.close()


def test_a_udp_punch_nobody_answers_ends_at_its_deadline_and_drops_strangers_datagrams():
    clock = SteppingClock()
    a, stranger, silent = udp_socket(), udp_socket(), udp_socket()
    try:
        stranger.sendto(b"\xc0 not the peer", a.getsockname())
        assert not punch_udp(a, silent.getsockname(), clock.monotonic() + 1.0, clock)
        with pytest.raises(BlockingIOError):
            a.recvfrom(64, socket.MSG_DONTWAIT)  # the stranger's datagram was taken off
        sent = 0
        while True:
            try:
                assert silent.recvfrom(64, socket.MSG_DONTWAIT)[0] == PUNCH_DATAGRAM
                sent += 1
            except BlockingIOError:
                break
        assert sent == round(1.0 / UDP_EVERY)  # one per pause, until the deadline
    finally:
        for sock in (a, stranger, silent):
            sock.close()


@pytest.fixture
def quic_sides(sides):
    """``sides`` with QUIC: each provider's certificate and a UDP socket for the other, named in its ports."""
    for name in ("a", "b"):
        side = sides[name]
        side["quic"] = QuicSockets.bind("127.0.0.1", [1 - side["index"]])
        side["ports"] = side["ports"].model_copy(update={"quic_pin": side["quic"].certificate.fingerprint.hex(),
                                                         "udp_ports": side["quic"].ports()})
    yield sides
    for name in ("a", "b"):
        sides[name]["quic"].close()


def test_a_pair_whose_tcp_punch_fails_links_over_quic_on_a_punched_udp_path_both_ways(quic_sides):
    sides = quic_sides
    made = {name: LinkPaths(sides[name]["index"], "127.0.0.1", sides[name]["engine"].port, sides[name]["ports"],
                            sides[name]["memory"], sides[name]["quic"], punch=never_answered) for name in ("a", "b")}
    try:
        ids = {0: "a", 1: "b"}
        book_a = made["a"].route({1: sides["relay"]}, ids, {1: sides["b"]["ports"]})
        book_b = made["b"].route({0: sides["relay"]}, ids, {0: sides["a"]["ports"]})
        assert ask(book_a[1], b"hello") == b"b-engine:hello"
        assert ask(book_b[0], b"hi") == b"a-engine:hi"
        assert made["a"].report() == {"b": {"path": "quic", "relay_bytes": 0}}
        assert made["b"].report() == {"a": {"path": "quic", "relay_bytes": 0}}
        assert not sides["a"]["memory"].worth_trying("b", "tcp") and sides["a"]["memory"].worth_trying("b", "quic")
    finally:
        for paths in made.values():
            paths.close()


# ---- what the review of the first version found ------------------------------------------------


def test_a_punch_cut_short_by_the_tasks_end_is_not_remembered_as_failed(sides):
    started = threading.Event()

    def until_cancelled(local, peer, deadline, clock, cancelled=None):
        started.set()
        cancelled.wait(30)
        return PunchResult(None, 1, "cancelled")
    a = paths_of(sides["a"], punch=until_cancelled)
    a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})
    assert started.wait(10)
    a.close()
    assert sides["a"]["memory"].worth_trying("b", "tcp") and sides["a"]["memory"].worth_trying("b", "quic")


def test_a_punch_that_raises_leaves_the_link_to_the_relay_instead_of_parking_it(sides):
    def broken(local, peer, deadline, clock, cancelled=None):
        raise TypeError("an address the system refuses")
    a = paths_of(sides["a"], punch=broken)
    try:
        book = a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})
        assert ask(book[1], b"hello") == b"relay:hello"
        assert a.report()["b"]["path"] == "relayed"
    finally:
        a.close()


def test_no_punch_goes_to_this_machines_loopback_unless_the_provider_is_reached_there_too(sides):
    calls = []

    def record(local, peer, deadline, clock, cancelled=None):
        calls.append(peer)
        return PunchResult(None, 1, "timed out")
    public = sides["a"]["ports"].model_copy(update={"host": "198.18.1.2"})
    a = paths_of(sides["a"], mine=public, punch=record)
    try:
        book = a.route({1: sides["relay"]}, {0: "a", 1: "b"}, {1: sides["b"]["ports"]})  # b names 127.0.0.1
        assert ask(book[1], b"hello") == b"relay:hello" and calls == []
    finally:
        a.close()


def test_a_task_run_whose_links_were_closed_routes_nothing_when_a_late_start_comes(sides):
    from types import SimpleNamespace

    from meshlearn.network.provider.enginelinks import EngineLinks

    ctx = SimpleNamespace(relayed=True, host="127.0.0.1", punch_memory=PunchMemory(), clock=None)
    links = EngineLinks(ctx, "t", 0)
    links.close()
    before = {thread.name for thread in threading.enumerate()}
    book = {1: sides["relay"]}
    assert links.route(book, {0: "a", 1: "b"}, {1: sides["b"]["ports"]}) is book
    assert {thread.name for thread in threading.enumerate()} - before == set()


@pytest.mark.parametrize("ports", [{"host": "0177.0.0.1", "out_port": 5}, {"host": "0.0.0.0", "out_port": 5},
                                   {"host": "224.0.0.1"}, {"host": "169.254.1.1"}, {"host": "999.1.1.1"},
                                   {"out_port": 5}, {"quic_pin": "0" * 64}, {"host": "10.0.0.1", "out_port": 0},
                                   {"host": "10.0.0.1", "quic_pin": "XYZ"}])
def test_punching_ports_from_the_network_name_a_reachable_host_for_every_port(ports):
    from meshlearn.errors import BadMessage

    with pytest.raises(BadMessage):
        PunchPorts.read(ports, "task.start")
