"""A network with no single point of failure, on loopback, for tests: k "machines", each an etcd
member and a bootstrap process keeping the registry in the members' cluster (TLS, client
certificates), plus providers and requesters as real `meshlearn` processes (``netproc.Processes``).
A machine dies whole (``kill``: SIGKILL to its bootstrap and its member) and comes back (``restart``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from helpers.etcdlab import READY, member_specs
from helpers.netproc import Processes, free_port

from meshlearn.network.bootstrap.etcd import EtcdClient
from meshlearn.network.bootstrap.etcdcluster import EtcdMember, client_urls, make_cluster_certs, member_tls
from meshlearn.network.bootstrap.etcdstore import ROOT
from meshlearn.network.bootstrap.registrystore import EtcdLocation


class ClusterLab:
    """``size`` machines (etcd member + bootstrap) sharing one registry; ``procs`` holds every process
    started through it, stopped by ``close``."""

    def __init__(self, folder: Path, procs: Processes, size: int = 3, ttl: float = 30.0):
        self.folder, self.procs, self.size, self.ttl = folder, procs, size, ttl
        self.tls_folder = folder / "tls"
        self.specs = member_specs(folder / "etcd", size)
        self.members: list[EtcdMember] = []
        self.ports = [free_port() for _ in range(size)]
        self.addresses: list[str] = [""] * size

    @property
    def registry(self) -> str:
        """``--registry`` of the bootstraps: every member's client address."""
        return "etcd://" + ",".join(f"{s.host}:{s.client_port}" for s in self.specs)

    @property
    def location(self) -> EtcdLocation:
        return EtcdLocation(tuple(client_urls(self.specs, True)), self.tls_folder)

    @property
    def bootstrap(self) -> str:
        """``--bootstrap`` of the peers: every bootstrap, pinned, comma-separated."""
        return ",".join(self.addresses)

    def start(self) -> ClusterLab:
        self.client_tls = make_cluster_certs(self.tls_folder, ["127.0.0.1"])
        self.members = [EtcdMember(spec, self.specs, member_tls(self.tls_folder)) for spec in self.specs]
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_ready(READY)
        for i in range(self.size):
            self.start_bootstrap(i)
        return self

    def start_bootstrap(self, i: int) -> str:
        """Start machine ``i``'s bootstrap (again); its pinned address once it serves."""
        name = f"bootstrap{i}"
        self.procs.start(name, "-v", "bootstrap", "--port", str(self.ports[i]), "--relay-port", "0",
                         "--state", str(self.folder / name / "unused.sqlite"), "--key",
                         str(self.folder / name / "bootstrap.key"), "--ttl", str(self.ttl),
                         "--registry", self.registry, "--registry-tls", str(self.tls_folder))
        found = self.procs.wait_for(name, r"other machines give --bootstrap (\S+)", timeout=60,
                                    accept=lambda m: True)
        self.addresses[i] = found.group(1)
        return self.addresses[i]

    def leader(self) -> int:
        """The machine whose member leads the cluster now."""
        client = self.client()
        try:
            endpoint = client.leader_endpoint()
        finally:
            client.close()
        urls = client_urls(self.specs, True)
        assert endpoint in urls, f"no leader among {urls}: {endpoint}"
        return urls.index(endpoint)

    def kill(self, i: int) -> None:
        """Machine ``i`` dies: its bootstrap and its etcd member, SIGKILL."""
        self.procs.kill(f"bootstrap{i}")
        self.members[i].kill()

    def restart(self, i: int) -> None:
        """Machine ``i`` comes back: its member (rejoining with its data) and its bootstrap."""
        self.members[i].start()
        self.members[i].wait_ready(READY)
        self.start_bootstrap(i)

    def client(self) -> EtcdClient:
        """A client of the cluster (the operator's certificate)."""
        return EtcdClient(client_urls(self.specs, True), self.client_tls)

    def registry_keys(self, part: bytes) -> dict[bytes, bytes]:
        """The registry's keys under ``part`` (say b"t/": every task's record), as the cluster holds them."""
        client = self.client()
        try:
            return {kv.key: kv.value for kv in client.range(ROOT + part)[0]}
        finally:
            client.close()

    def close(self) -> None:
        self.procs.stop_all()
        for member in self.members:
            member.stop()


@contextlib.contextmanager
def cluster_lab(folder: Path, size: int = 3, ttl: float = 30.0) -> Iterator[ClusterLab]:
    """A started ``ClusterLab`` under ``folder``, closed whatever happens."""
    lab = ClusterLab(folder, Processes(folder), size, ttl)
    try:
        yield lab.start()
    finally:
        lab.close()
