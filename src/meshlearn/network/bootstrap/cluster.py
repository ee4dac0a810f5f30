"""A network without a single point of failure on one machine, to try it (``meshlearn cluster``):
``size`` etcd members and ``size`` bootstraps, each bootstrap its own process keeping the registry in
the members' cluster, over TLS with the certificates made here. Across machines the same pieces run
one per machine (docs/network.md, "Several bootstraps, one registry")."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from meshlearn.errors import NetworkError, UserInputError
from meshlearn.network.bootstrap.etcdcluster import (
    EtcdMember,
    MemberSpec,
    dying_with_this_process,
    make_cluster_certs,
    member_tls,
)
from meshlearn.network.channel.identity import load_or_create_key
from meshlearn.network.channel.rpc import call

READY_WITHIN = 60.0  # seconds each bootstrap has to answer once started
MAX_SIZE = 7  # members of one cluster here (3 or 5 is the rule: a majority of them must live)


class LocalCluster:
    """``size`` machines' worth of the network on this one: member ``i`` of the etcd cluster on
    ``etcd_port + 2i`` (its peers on the port after), bootstrap ``i`` on ``port + 2i`` (its relay on
    the port after), everything under ``folder``. ``run()`` starts them, says the ``--bootstrap``
    peers give, and stops them all when ``stop`` is set or one dies."""

    def __init__(self, folder: Path, size: int, host: str, port: int, etcd_port: int, secret: bytes,
                 say: Callable[[str], None] = print):
        if not 1 <= size <= MAX_SIZE or size % 2 == 0:
            raise UserInputError(f"--size {size}: give an odd number of bootstraps from 1 to {MAX_SIZE} (3 or 5: "
                                 "the network lives while a majority does)")
        self.folder, self.size, self.host, self.secret, self.say = Path(folder), size, host, secret, say
        self.ports = [port + 2 * i for i in range(size)]
        self.specs = [MemberSpec(f"member{i}", host, etcd_port + 2 * i, etcd_port + 2 * i + 1,
                                 self.folder / f"member{i}") for i in range(size)]
        self.members: list[EtcdMember] = []
        self.bootstraps: list[subprocess.Popen] = []

    @property
    def registry(self) -> str:
        """The bootstraps' ``--registry``: every member's client address."""
        return "etcd://" + ",".join(f"{spec.host}:{spec.client_port}" for spec in self.specs)

    def run(self, stop: threading.Event) -> None:
        """Start the members and the bootstraps, say where they are, serve until ``stop``; stop them all."""
        try:
            addresses = self._start()
            self.say(f"{self.size} bootstraps share one registry (etcd {self.registry}, TLS files in "
                     f"{self.folder / 'tls'}); logs in {self.folder}")
            self.say(f"providers and requesters give --bootstrap {','.join(addresses)}")
            while not stop.wait(0.5):
                dead = [i for i, proc in enumerate(self.bootstraps) if proc.poll() is not None]
                if dead:
                    raise NetworkError(f"bootstrap {dead[0]} exited: see {self.folder / f'bootstrap{dead[0]}.log'}")
        finally:
            self._stop()

    def _start(self) -> list[str]:
        make_cluster_certs(self.folder / "tls", [self.host])
        self.members = [EtcdMember(spec, self.specs, member_tls(self.folder / "tls")) for spec in self.specs]
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_ready()
        return [self._start_bootstrap(i) for i in range(self.size)]

    def _start_bootstrap(self, i: int) -> str:
        """Bootstrap ``i`` as its own process (dying with this one); its pinned address once it answers."""
        home = self.folder / f"bootstrap{i}"
        home.mkdir(parents=True, exist_ok=True)
        keys = load_or_create_key(home / "bootstrap.key")[0]
        command = [sys.executable, "-m", "meshlearn", "bootstrap", "--host", self.host, "--port", str(self.ports[i]),
                   "--key", str(home / "bootstrap.key"), "--state", str(home / "registry.sqlite"),
                   "--registry", self.registry, "--registry-tls", str(self.folder / "tls")]
        env = {**os.environ, "MESHLEARN_SECRET": self.secret.decode(errors="replace")}
        with open(self.folder / f"bootstrap{i}.log", "ab") as log:
            self.bootstraps.append(subprocess.Popen(dying_with_this_process(command), stdin=subprocess.DEVNULL,
                                                    stdout=log, stderr=subprocess.STDOUT, env=env,
                                                    start_new_session=True))
        address = f"{self.host}:{self.ports[i]}@{keys.text}"
        deadline = time.monotonic() + READY_WITHIN
        while True:
            try:
                call(address, "ping", {}, self.secret, timeout=2)
                return address
            except NetworkError:
                if self.bootstraps[i].poll() is not None or time.monotonic() > deadline:
                    raise NetworkError(f"bootstrap {i} did not start: see {self.folder / f'bootstrap{i}.log'}") \
                        from None

    def _stop(self) -> None:
        for proc in self.bootstraps:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.bootstraps:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for member in self.members:
            member.stop()
