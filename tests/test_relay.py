"""The relay on loopback: real sockets, an echo server behind an agent, clients through an allocation."""

from __future__ import annotations

import socket
import threading

import pytest
from helpers.waiting import wait_until

from meshlearn.network.relay import Relay, RelayAgent, fetch_key_line


@pytest.fixture
def relay():
    service = Relay("127.0.0.1", 0, "127.0.0.1", key_line="THE-KEY")
    service.start()
    yield service
    service.stop()


@pytest.fixture
def echo():
    """A server that sends back what it reads, on every connection."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                             daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    yield listener.getsockname()[1]
    listener.close()


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _exchange(address: str, payload: bytes) -> bytes:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += sock.recv(1 << 20)
    return got


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
        host, port = public.rsplit(":", 1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, int(port)), timeout=5).close()
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
    from meshlearn.network.relay import MAX_PARKED, MAX_PER_OWNER

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
        allocation = relay._allocations[tokens[0]]
        assert wait_until(lambda: relay.refused == 3, timeout=5)
        assert len(allocation.parked) == MAX_PARKED
    finally:
        for sock in parked:
            sock.close()


def test_a_provider_the_bootstrap_cannot_dial_is_served_through_the_relay_even_after_a_bootstrap_restart(tmp_path):
    """In one process: the provider announces an address that is not where its requests come
    from, so the bootstrap does not dial it and hands it a relay allocation instead."""
    from helpers.netproc import running_in_thread

    from meshlearn.network.bootstrap import Bootstrap, BootstrapSettings
    from meshlearn.network.identity import KeyPair
    from meshlearn.network.provider import Provider, ProviderSettings
    from meshlearn.network.rpc import call

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
        assert wait_until(lambda: _port_free(port), timeout=10)
        second = bootstrap()
        with running_in_thread(second):
            assert wait_until(lambda: "home" in listed(second), timeout=20)
            again = listed(second)["home"]["address"]
            assert again != relayed
            assert call(again, "ping", {}, secret, timeout=5).body["id"] == "home"
