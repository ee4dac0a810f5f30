"""An insider with the network secret cannot fill the relay's allocation pool.

Keys cost a holder of the secret nothing: 40 keys speaking from 8 loopback addresses
(127.0.0.11-18) ask for every allocation they can get, the way the second insider audit did,
and keep each one served by a parked agent connection. The relay gives allocations only for
registered work (a provider registering, a task claimed), bounded per key and per address, so
a new provider behind NAT still gets its allocation at its first ask, and a task runs through it.
Real processes on loopback; the attack from this process.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading

import pytest
from helpers.netproc import SECRET, free_port

from meshlearn.errors import NetworkError
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.channel.rpc import call

KEYS, ADDRESSES, IDS_PER_KEY = 40, 8, 8
TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--epochs", "2",
        "--providers", "2", "--location", "home-lab"]


class Insider:
    """One key of the attacker, speaking from ``source``: registers providers it does not run
    through the relay, parks an agent connection on each allocation it gets, and counts."""

    def __init__(self, bootstrap: str, source: str, number: int):
        self.bootstrap, self.source, self.number = bootstrap, source, number
        self.keys = KeyPair.generate()
        self.allocations: list[str] = []  # public addresses
        self.registered: list[str] = []
        self.refused: list[str] = []
        self.parked: list[socket.socket] = []

    def ask(self, kind: str, body: dict) -> dict:
        plain, _, key = self.bootstrap.rpartition("@")
        where = f"{self.source}:0;{plain}@{key}"  # ZeroMQ: SOURCE:PORT;HOST:PORT, from this address
        return call(where, kind, body, SECRET.encode(), timeout=20, sender=f"insider-{self.number}",
                    keys=self.keys).body

    def attack(self) -> None:
        for kind, body in (("relay.open", {}), ("relay.open", {"task": "someone-elses"})):
            try:
                self.allocations.append(self.ask(kind, body)["address"])
            except NetworkError as exc:
                self.refused.append(f"{kind} {body}: {exc}")
        for k in range(IDS_PER_KEY):
            pid = f"fake-{self.number}-{k}"
            info = {"id": pid, "address": f"192.0.2.{self.number % 250 + 1}:7000", "ram_gb": 64, "cores": 64,
                    "device": "cpu", "location": "insider"}
            try:
                self.ask("register", info)  # not dialable: told to come back through the relay
                opened = self.ask("relay.open", {"provider": pid})
                self.allocations.append(opened["address"])
                self._park(opened["relay"], opened["token"])
                if self.ask("register", {**info, "address": opened["address"]}).get("registered"):
                    self.registered.append(pid)
            except NetworkError as exc:
                self.refused.append(f"{pid}: {exc}")

    def _park(self, relay: str, token: str) -> None:
        host, _, port = relay.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=10, source_address=(self.source, 0))
        sock.sendall(f"AGENT {token}\n".encode())
        self.parked.append(sock)

    def close(self) -> None:
        for sock in self.parked:
            sock.close()


def _loopback_aliases_work() -> bool:
    try:
        with socket.create_connection(("127.0.0.1", 9), timeout=1, source_address=("127.0.0.11", 0)):
            pass
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return True


# slow (about 35 s): the default run keeps the pool's rules below (eviction of the never-registered, the
# bounds per key and address, allocations closed with their work), each on a bootstrap of its own
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux) to set the file limit")
@pytest.mark.skipif(not _loopback_aliases_work(), reason="needs 127.0.0.0/8 on loopback (Linux)")
def test_40_insider_keys_on_8_addresses_leave_room_for_a_new_provider_behind_nat_and_its_task(procs):
    port = free_port()
    procs.start("bootstrap", "-v", "bootstrap", "--port", str(port), "--state", str(procs.folder / "registry.sqlite"),
                "--relay-port", "0", prefix=("prlimit", "--nofile=4096:4096"))
    bootstrap = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
    insiders = [Insider(bootstrap, f"127.0.0.{11 + i % ADDRESSES}", i) for i in range(KEYS)]
    try:
        by_address = [[ins for ins in insiders if ins.source == f"127.0.0.{11 + a}"] for a in range(ADDRESSES)]
        threads = [threading.Thread(target=lambda group=group: [ins.attack() for ins in group]) for group in by_address]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        held = sum(len(ins.allocations) for ins in insiders)
        refusals = [r for ins in insiders for r in ins.refused]
        # newcomers behind NAT (they announce an address the bootstrap does not dial)
        for name in ("home", "home2"):
            procs.start(name, "provider", "--bootstrap", bootstrap, "--id", name, "--workdir",
                        str(procs.folder / name), "--advertise", "192.0.2.250", "--location", "home-lab")
        for name in ("home", "home2"):
            procs.wait_for(name, "registered with", timeout=60)
            log = procs.log(name)
            assert "peers reach it through the relay" in log, log
            assert "try again later" not in log and "allocations already" not in log, log  # at its first ask
            assert procs.wait_for("bootstrap", rf"allocated to key \S+ for provider {name}\b")

        request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(procs.folder / "req"),
                              *TASK)
        assert request.wait(timeout=300) == 0, procs.log("req")
        metrics = json.loads((procs.folder / "req" / "metrics.json").read_text())
        assert sorted(metrics["providers"]) == ["home", "home2"] and metrics["accuracy"] > 0.5, metrics
        assert procs.wait_for("bootstrap", r"allocated to key \S+ for task ")  # the engines, relayed too
        # a key that registered nothing gets no allocation, nor one for a task it has no part in
        assert all(not r.startswith("relay.open") or "registered work only" in r or "register first" in r
                   for r in refusals), refusals[:5]
        assert sum(r.startswith("relay.open") for r in refusals) == 2 * KEYS, refusals[:5]
        assert held > 0 and sum(len(ins.registered) for ins in insiders) > 0  # the attack did get what caps allow

        print(f"insiders held {held} allocations, registered "
              f"{sum(len(ins.registered) for ins in insiders)} providers; refused {len(refusals)} asks")
    finally:
        for ins in insiders:
            ins.close()



# --- the rules, in one process -------------------------------------------------------------


def test_the_relay_evicts_only_allocations_of_providers_that_never_registered(monkeypatch):
    """A full pool makes room by closing the oldest unsettled allocation; one full of allocations
    serving registered work refuses the newcomer instead."""
    from meshlearn.network.channel import allocations
    from meshlearn.network.channel.allocations import Holder
    from meshlearn.network.channel.relay import Relay

    monkeypatch.setattr(allocations, "MAX_ALLOCATIONS", 6)
    relay = Relay("127.0.0.1", 0, "127.0.0.1")
    relay.start()
    try:
        assert relay.pool_size() == 6
        made = [relay.allocate(f"key-{i}", f"198.51.100.{i}", Holder("provider", f"p{i}"), settled=False)[1]
                for i in range(6)]
        newcomer = relay.allocate("key-new", "203.0.113.1", Holder("provider", "new"), settled=False)[1]
        assert relay.holder_of(made[0]) is None and relay.holder_of(newcomer) == Holder("provider", "new")
        assert relay.settle(newcomer, "key-new", Holder("provider", "new"))
        assert not relay.settle(made[1], "key-new", Holder("provider", "p1"))  # not this key's
        for i, public in enumerate(made[1:], start=1):
            assert relay.settle(public, f"key-{i}", Holder("provider", f"p{i}"))
        with pytest.raises(NetworkError, match="all serving registered providers and tasks"):
            relay.allocate("key-late", "203.0.113.2", Holder("task", "t"))
        # a provider has one allocation: a new one replaces its earlier one
        again = relay.allocate("key-1", "198.51.100.1", Holder("provider", "p1"))[1]
        assert relay.holder_of(made[1]) is None and relay.holder_of(again) == Holder("provider", "p1")
        assert relay.release_holder(Holder("provider", "p1")) == 1 and relay.holder_of(again) is None
    finally:
        relay.stop()


def test_registrations_are_bounded_per_key_and_address_and_only_the_silent_make_room():
    from dataclasses import dataclass

    from meshlearn.errors import BadMessage
    from meshlearn.network.bootstrap.registrants import Registrants

    @dataclass
    class P:
        id: str
        key: str
        status: str = "free"
        last_seen: float = 100.0

    bounds = Registrants(per_key=2, per_address=3)
    registered = [P("a", "k1", last_seen=10.0), P("b", "k1", status="busy", last_seen=5.0)]
    for p in registered:
        assert bounds.make_room(p.id, p.key, "198.51.100.1", [q for q in registered if q is not p], 50.0) == []
    assert bounds.make_room("a", "k1", "198.51.100.1", registered, 50.0) == []  # registering again: no room needed
    # a third provider of key k1: "a" is silent (heard from at 10, before 50) and free, "b" at work
    assert bounds.make_room("c", "k1", "198.51.100.9", registered, 50.0) == ["a"]
    registered = [registered[1], P("c", "k1")]
    with pytest.raises(BadMessage, match="this key keeps 2 providers registered already"):
        bounds.make_room("d", "k1", "198.51.100.9", registered, 50.0)  # "b" at work, "c" alive
    # the address's bound: three from 198.51.100.9 at most
    registered += [P("e", "k2"), P("f", "k3")]
    assert bounds.make_room("e", "k2", "198.51.100.9", registered, 50.0) == []
    assert bounds.make_room("f", "k3", "198.51.100.9", registered, 50.0) == []
    with pytest.raises(BadMessage, match="198.51.100.9 keeps 3 providers registered already"):
        bounds.make_room("g", "k4", "198.51.100.9", registered, 50.0)
    assert bounds.make_room("g", "k4", "198.51.100.10", registered, 50.0) == []  # another address is not affected


def test_the_bootstrap_gives_allocations_for_registered_work_and_closes_them_when_it_ends(tmp_path):
    from helpers.netproc import running_in_thread
    from helpers.waiting import wait_until

    from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
    from meshlearn.network.channel.allocations import Holder

    secret = SECRET.encode()
    settings = BootstrapSettings(host="127.0.0.1", port=free_port(), relay_port=0, state=str(tmp_path / "b.sqlite"))
    boot = Bootstrap(settings, secret, keys=KeyPair.generate())
    provider, requester, stranger = KeyPair.generate(), KeyPair.generate(), KeyPair.generate()

    def ask(keys, kind, body):
        return call(boot.address, kind, body, secret, timeout=10, keys=keys).body

    info = {"id": "x", "address": "192.0.2.9:7000", "ram_gb": 1, "cores": 1, "device": "cpu"}
    with running_in_thread(boot):
        for body, refusal in (({}, "registered work only"), ({"provider": "x"}, "register first"),
                              ({"task": "t1"}, "registered work only")):
            with pytest.raises(NetworkError, match=refusal):
                ask(provider, "relay.open", body)
        assert ask(provider, "register", info)["reachable"] is False  # told to come back through the relay
        with pytest.raises(NetworkError, match="not registering with this key"):
            ask(stranger, "relay.open", {"provider": "x"})
        front = ask(provider, "relay.open", {"provider": "x"})["address"]
        assert ask(provider, "register", {**info, "address": front})["registered"] == "x"
        assert ask(requester, "claim", {"task": "t1", "count": 1})["providers"][0]["id"] == "x"
        engine = ask(provider, "relay.open", {"task": "t1"})["address"]
        share = ask(requester, "relay.open", {"task": "t1"})["address"]
        with pytest.raises(NetworkError, match="not a running task this key requested or was claimed for"):
            ask(stranger, "relay.open", {"task": "t1"})
        assert {boot.relay.holder_of(a) for a in (engine, share)} == {Holder("task", "t1")}
        ask(requester, "release", {"task": "t1"})
        assert wait_until(lambda: boot.relay.holder_of(engine) is None and boot.relay.holder_of(share) is None,
                          timeout=10)
        assert boot.relay.holder_of(front) == Holder("provider", "x")  # its registration still holds it
        ask(provider, "leave", {"id": "x"})
        assert wait_until(lambda: boot.relay.holder_of(front) is None, timeout=10)
