"""The relay on loopback: real sockets, an echo server behind an agent, clients through an allocation."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from helpers.netproc import port_free
from helpers.waiting import wait_until

from meshlearn.network.channel.probes import fetch_key_line
from meshlearn.network.channel.relay import Relay
from meshlearn.network.channel.relayagent import RelayAgent


@pytest.fixture
def relay():
    service = Relay("127.0.0.1", 0, "127.0.0.1", key_line="THE-KEY")
    service.start()
    yield service
    service.stop()


@pytest.fixture
def echo():
    """A server that sends back what it reads, on every connection (closed when its client goes)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket):
        with conn:
            try:
                for data in iter(lambda: conn.recv(65536), b""):
                    conn.sendall(data)
            except OSError:
                pass  # reset: a relay dropped the connection

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _exchange(address: str, payload: bytes) -> bytes:
    """What comes back of ``payload`` through ``address`` (an echo server behind it); short if
    the connection is closed first."""
    with socket.create_connection(_host_port(address), timeout=10) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            got += chunk
    return got


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def _connections(address: str, count: int, greeting: bytes = b""):
    """``count`` connections to ``address``, each having sent ``greeting`` (or nothing), then
    silent; all closed on the way out."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.create_connection(_host_port(address), timeout=10)
            socks.append(sock)
            if greeting:
                sock.sendall(greeting)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc (Linux)")


def test_clients_reach_a_server_through_an_allocation_both_ways_and_concurrently(relay, echo):
    token, public = relay.allocate()
    agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}", parked=2)
    agent.start()
    try:
        payloads = [bytes([i]) * (3 << 20) + b"end" for i in range(5)]  # more clients than parked connections
        results = [None] * len(payloads)
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, _exchange(public, payloads[i])))
                   for i in range(len(payloads))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert results == payloads
        assert relay.spliced == len(payloads)
        assert _exchange(public, b"again") == b"again"  # the agent parked fresh connections
    finally:
        agent.stop()


def test_the_relay_port_announces_the_key_and_refuses_unknown_tokens(relay):
    assert fetch_key_line(relay.address) == "THE-KEY"
    with socket.create_connection(("127.0.0.1", relay.port), timeout=5) as sock:
        sock.sendall(b"AGENT not-a-token\n")
        sock.settimeout(5)
        assert sock.recv(10) == b""  # closed: it named no allocation
    assert relay.spliced == 0


def test_an_allocation_whose_agent_is_gone_is_closed(echo):
    relay = Relay("127.0.0.1", 0, "127.0.0.1", client_wait=1.0, idle_close=0.5, sweep_every=0.1)
    relay.start()
    try:
        token, public = relay.allocate("key-a")
        agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}", parked=2)
        agent.start()
        assert _exchange(public, b"x") == b"x"
        agent.stop()  # its parked connections close: the relay drops them, then the allocation
        assert wait_until(lambda: relay.owner_of(public) is None, timeout=10)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(_host_port(public), timeout=5).close()
    finally:
        relay.stop()


def test_an_agent_whose_allocation_the_relay_forgot_says_it_is_lost(relay, echo):
    token, _ = relay.allocate("key-a")
    assert relay.release(token, "key-b") is False  # only its owner gives it back
    assert relay.release(token, "key-a") is True
    agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}", parked=1)
    agent.start()
    try:
        assert agent.lost.wait(20)
    finally:
        agent.stop()


def test_what_one_participant_can_make_the_relay_hold_is_capped(relay):
    from meshlearn.errors import NetworkError
    from meshlearn.network.channel.agentport import MAX_PARKED
    from meshlearn.network.channel.allocations import MAX_PER_OWNER

    tokens = [relay.allocate("key-a")[0] for _ in range(MAX_PER_OWNER)]
    with pytest.raises(NetworkError, match="holds 8 relay allocations"):
        relay.allocate("key-a")
    relay.allocate("key-b")  # another participant is not affected
    parked = []
    try:
        for _ in range(MAX_PARKED + 3):
            sock = socket.create_connection(("127.0.0.1", relay.port), timeout=5)
            sock.sendall(f"AGENT {tokens[0]}\n".encode())
            parked.append(sock)
        allocation = relay._allocations.get(tokens[0])
        assert wait_until(lambda: relay.refused == 3, timeout=5)
        assert len(allocation.parked) == MAX_PARKED
    finally:
        for sock in parked:
            sock.close()


ZMTP_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)


def test_silent_connections_to_the_agent_port_do_not_block_key_fetches(relay):
    """300 connections that never send a line, held open: each newcomer evicts the oldest silent
    one, so all 65 clients asking for the key (trust on first use) are answered."""
    with _connections(relay.address, 300):
        answers = [fetch_key_line(relay.address) for _ in range(65)]
    assert answers == ["THE-KEY"] * 65
    assert relay.evicted > 0


def test_strangers_holding_connections_to_an_allocation_do_not_stop_its_clients(relay, echo):
    """100 silent connections and 100 that sent a ZeroMQ greeting and went silent, held open
    while a client keeps exchanging through the allocation: every exchange succeeds. On loopback
    everyone shares 127.0.0.1, so the cap per address does not tell them apart: evicting the
    connection idle longest is what lets the busy client in."""
    token, public = relay.allocate("key-a")
    agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}")
    agent.start()
    try:
        assert _exchange(public, b"hello") == b"hello"
        with _connections(public, 100), _connections(public, 100, ZMTP_GREETING):
            payloads = [b"ping %d" % i for i in range(40)]
            assert [_exchange(public, payload) for payload in payloads] == payloads
        assert relay.evicted > 0
    finally:
        agent.stop()


@needs_proc
def test_insiders_and_strangers_cost_the_relay_no_thread_and_descriptors_within_its_caps():
    """Allocations are capped per key, per address and in all; then 300 silent connections (150
    to the agent port, 30 to each of five allocations' ports): the relay's one thread serves it
    all and holds only what its caps allow; stopping it gives every thread and descriptor back."""
    from meshlearn.errors import NetworkError
    from meshlearn.network.channel.agentport import MAX_GREETING_PER_ADDRESS
    from meshlearn.network.channel.allocations import MAX_PER_OWNER
    from meshlearn.network.channel.publicports import MAX_CLIENTS_PER_ADDRESS

    threads, descriptors = threading.active_count(), _open_descriptors()
    relay = Relay("127.0.0.1", 0, "127.0.0.1", key_line="THE-KEY")
    relay.start()
    try:
        publics = [relay.allocate("key-a", "198.51.100.1")[1] for _ in range(MAX_PER_OWNER)]
        with pytest.raises(NetworkError, match="this key holds 8 relay allocations"):
            relay.allocate("key-a", "198.51.100.2")
        publics += [relay.allocate(f"key-{i}", "198.51.100.1")[1]
                    for i in range(relay.per_address() - MAX_PER_OWNER)]
        with pytest.raises(NetworkError, match=f"198.51.100.1 holds {relay.per_address()} relay allocations"):
            relay.allocate("key-new", "198.51.100.1")
        most = relay.pool_size()
        publics += [relay.allocate(f"key-b{i}", f"203.0.113.{i % 200}")[1] for i in range(most - len(publics))]
        with pytest.raises(NetworkError, match=f"the relay holds {most} allocations"):
            relay.allocate("key-last", "192.0.2.1")
        ports = publics[:5]
        with contextlib.ExitStack() as held:
            held.enter_context(_connections(relay.address, 150))
            for public in ports:
                held.enter_context(_connections(public, 30))
            assert wait_until(lambda: relay.accepted >= 300, timeout=20)
            assert fetch_key_line(relay.address) == "THE-KEY"
            grown_threads = threading.active_count() - threads
            grown_descriptors = _open_descriptors() - descriptors
        listeners, loop = 1 + most, 3  # the loop: its selector and its wake-up pair
        relay_held = MAX_GREETING_PER_ADDRESS + len(ports) * MAX_CLIENTS_PER_ADDRESS  # all from 127.0.0.1
        assert grown_threads <= 2
        assert grown_descriptors <= 300 + listeners + loop + relay_held + 8  # 8: whatever else opens meanwhile
    finally:
        relay.stop()
    assert threading.active_count() <= threads
    assert wait_until(lambda: _open_descriptors() <= descriptors, timeout=10)


_LIMITED_RELAY = """
import json, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from meshlearn.network.channel.relay import Relay
relay = Relay("127.0.0.1", 0, "127.0.0.1", key_line="THE-KEY")
relay.start()
hoard, reply = [], {"relay": relay.address}
for command in sys.stdin:
    if command.startswith("exhaust"):  # the rest of the process takes every descriptor left
        try:
            while True:
                hoard.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
    elif command.startswith("free"):
        while hoard:
            os.close(hoard.pop())
    elif command.startswith("allocate"):
        reply["token"], reply["public"] = relay.allocate("key-a")
    try:
        reply["descriptors"] = len(os.listdir("/proc/self/fd"))
    except OSError:
        reply["descriptors"] = -1
    print(json.dumps({**reply, "paused": relay.paused, "hoarded": len(hoard)}), flush=True)
relay.stop()
"""


@needs_proc
def test_a_relay_out_of_descriptors_pauses_accepting_and_then_serves_again(echo, tmp_path):
    """A relay in a process limited to 256 open files. 400 connections do not make it run out
    (it holds at most half the limit) and KEY is still answered; when the rest of the process
    takes every descriptor, the relay stops accepting for a moment, not for good: once some are
    free it answers KEY and splices through a fresh allocation."""
    from meshlearn.errors import NetworkError

    with open(tmp_path / "relay.log", "w") as errors:
        child = subprocess.Popen([sys.executable, "-c", _LIMITED_RELAY], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=errors, text=True)
    agent = None

    def ask(command: str) -> dict:
        child.stdin.write(command + "\n")
        child.stdin.flush()
        return json.loads(child.stdout.readline())
    try:
        state = ask("allocate")
        address, baseline = state["relay"], state["descriptors"]
        with _connections(address, 200), _connections(state["public"], 200):
            assert fetch_key_line(address) == "THE-KEY"
            assert ask("stats")["paused"] == 0  # its caps kept it within the limit
        assert wait_until(lambda: ask("stats")["descriptors"] <= baseline, timeout=20)
        assert ask("exhaust")["hoarded"] > 0
        with pytest.raises(NetworkError):
            fetch_key_line(address, timeout=1)
        assert ask("stats")["paused"] > 0
        ask("free")
        assert fetch_key_line(address) == "THE-KEY"
        state = ask("allocate")
        agent = RelayAgent(address, state["token"], f"127.0.0.1:{echo}")
        agent.start()
        payload = os.urandom(1 << 20)
        assert _exchange(state["public"], payload) == payload
    finally:
        if agent is not None:
            agent.stop()
        child.kill()
        child.communicate()


def test_without_os_splice_the_bytes_go_through_a_buffer(monkeypatch, echo):
    """Where os.splice does not exist, relay and agent copy through the loop's buffer instead."""
    from meshlearn.network.channel import splicer

    monkeypatch.setattr(splicer, "ZERO_COPY", False)
    relay = Relay("127.0.0.1", 0, "127.0.0.1")
    relay.start()
    token, public = relay.allocate()
    agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}", parked=1)
    agent.start()
    try:
        payload = os.urandom(3 << 20)
        assert _exchange(public, payload) == payload
        assert relay._splicer.pipes is None
    finally:
        agent.stop()
        relay.stop()


def test_a_provider_the_bootstrap_cannot_dial_is_served_through_the_relay_even_after_a_bootstrap_restart(tmp_path):
    """In one process: the provider announces an address that is not where its requests come
    from, so the bootstrap does not dial it and hands it a relay allocation instead."""
    from helpers.netproc import running_in_thread

    from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
    from meshlearn.network.channel.identity import KeyPair
    from meshlearn.network.channel.rpc import call
    from meshlearn.network.provider.service import Provider, ProviderSettings

    secret = b"relay-test-secret-01"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = BootstrapSettings(host="127.0.0.1", port=port, relay_port=0, state=str(tmp_path / "b.sqlite"), ttl=1.5)
    boot_keys, provider_keys = KeyPair.generate(), KeyPair.generate()

    def bootstrap():
        return Bootstrap(settings, secret, keys=boot_keys)

    def listed(service):
        found = call(service.address, "discover", {"free_only": False}, secret, timeout=5).body["providers"]
        return {p["id"]: p for p in found}

    provider = Provider(ProviderSettings(bootstrap=f"127.0.0.1:{port}@{boot_keys.text}", host="127.0.0.1",
                                         advertise="192.0.2.123", provider_id="home", workdir=str(tmp_path / "home")),
                        secret, keys=provider_keys)
    first = bootstrap()
    with running_in_thread(first), running_in_thread(provider):
        entry = listed(first)["home"]
        relayed = entry["address"]
        assert provider.relayed and entry["reachable"] is False
        assert relayed == f"{provider.address}@{provider_keys.text}"
        assert first.relay.owner_of(provider.address) == provider_keys.text
        assert call(relayed, "ping", {}, secret, timeout=5).body["id"] == "home"  # through the relay
        # another key cannot register at the relay address someone else holds
        reply = call(first.address, "register", {"id": "squatter", "address": provider.address, "ram_gb": 1,
                                                 "cores": 1, "device": "cpu"}, secret, timeout=10).body
        assert reply["reachable"] is False and "squatter" not in listed(first)
        first.stop()  # the bootstrap restarts: its relay's allocations are gone
        assert wait_until(lambda: port_free(port), timeout=10)
        second = bootstrap()
        with running_in_thread(second):
            assert wait_until(lambda: "home" in listed(second), timeout=20)
            again = listed(second)["home"]["address"]  # a new allocation (the OS may give it the freed port again)
            assert second.relay.owner_of(again.partition("@")[0]) == provider_keys.text
            assert call(again, "ping", {}, secret, timeout=5).body["id"] == "home"
