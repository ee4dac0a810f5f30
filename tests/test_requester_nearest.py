"""The quick sibling of the network's end-to-end "nearest" test (slow: real processes behind a
delaying proxy): a requester asked to prefer the nearest providers orders the free ones by their
lowest round trip, with a bootstrap in this process and providers whose ping answers late."""

from __future__ import annotations

import threading

from helpers.netproc import running_in_thread

from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.spec import TaskRequest

SECRET = b"nearest-test-secret"
LATE = 0.1  # seconds a far provider's ping takes before it answers: far above a loopback round trip


def _provider(name: str, late: bool) -> RpcServer:
    """A provider's server answering ping, at once or ``LATE``."""
    held = threading.Event()  # never set: waiting on it is the far provider's delay

    def ping(request) -> dict:
        if late:
            held.wait(LATE)
        return {"service": "provider", "id": name}

    return RpcServer(name, "127.0.0.1", 0, SECRET, {"ping": ping})


def test_the_nearest_free_providers_come_first_by_their_lowest_round_trip(tmp_path):
    providers = {name: _provider(name, late=name.startswith("far")) for name in ("far0", "p0", "far1", "p1")}
    bootstrap = Bootstrap(BootstrapSettings(host="127.0.0.1", port=0, state=str(tmp_path / "b.sqlite"),
                                            dial_back=False), SECRET)
    for server in providers.values():
        server.start()
    try:
        with running_in_thread(bootstrap):
            for name, server in providers.items():
                call(bootstrap.server.address, "register", {"id": name, "address": server.address, "ram_gb": 8.0,
                                                            "cores": 2, "device": "cpu"}, SECRET, timeout=5)
            said: list[str] = []
            requester = Requester(TaskRequest(data_on_providers="digits", providers=2, prefer="nearest"),
                                  bootstrap.server.address, SECRET, tmp_path / "req", say=said.append)
            order = requester.nearest()
        assert sorted(order[:2]) == ["p0", "p1"] and sorted(order[2:]) == ["far0", "far1"], order
        assert any(line.startswith("round-trip times: ") for line in said), said
    finally:
        for server in providers.values():
            server.stop()
