"""Start the network's services as real processes on loopback, and always stop them."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

SECRET = "test-network-secret"


def requester_keys():
    """The key pair every `meshlearn request` of this test session proves (requester.key in the
    session's $MESHLEARN_HOME): the only key a provider answers about the requester's tasks."""
    from meshlearn.network.channel.identity import load_or_create_key, state_home

    return load_or_create_key(state_home() / "requester.key")[0]


def bindable(kind: int, port: int) -> bool:
    """Whether ``port`` on loopback can be bound for ``kind`` (SOCK_STREAM, SOCK_DGRAM) now."""
    with socket.socket(socket.AF_INET, kind) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def port_free(port: int) -> bool:
    """Whether ``port`` is free on loopback for TCP and for UDP (a bootstrap holds both: its
    reflector answers on the same number)."""
    return all(bindable(kind, port) for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM))


def free_port() -> int:
    """A free loopback port P whose P + 1 is free too: a bootstrap's relay listens on --port + 1,
    and a busy neighbour port would fail the start with "give the relay another port". Free for
    UDP too: the bootstrap answers reflexive-address requests on the same port numbers."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second, \
                socket.socket(type=socket.SOCK_DGRAM) as udp_first, socket.socket(type=socket.SOCK_DGRAM) as udp_second:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            try:
                second.bind(("127.0.0.1", port + 1))
                udp_first.bind(("127.0.0.1", port))
                udp_second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free pair of neighbouring ports on 127.0.0.1")


class Processes:
    """Spawned `meshlearn` processes with their logs; ``stop_all()`` kills whatever is left."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, secret: str = SECRET, prefix: tuple[str, ...] = (),
              env: dict | None = None) -> subprocess.Popen:
        """Start ``meshlearn ARGS`` (after ``prefix``, say ``ip netns exec NS``), its output in NAME.log."""
        env = {**os.environ, "MESHLEARN_SECRET": secret, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
               **(env or {})}
        log = open(self.folder / f"{name}.log", "w")
        proc = subprocess.Popen([*prefix, sys.executable, "-m", "meshlearn", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def wait_for(self, name: str, pattern: str, timeout: float = 60.0,
                 accept: Callable[[re.Match], bool] | None = None) -> re.Match:
        """The first match of ``pattern`` in ``name``'s log (that ``accept`` takes), once it appears."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for found in re.finditer(pattern, self.log(name)):
                if accept is None or accept(found):
                    return found
            if self.procs[name].poll() is not None:
                raise AssertionError(f"{name} exited ({self.procs[name].returncode}):\n{self.log(name)}")
            time.sleep(0.1)
        raise AssertionError(f"{name} never printed {pattern!r}:\n{self.log(name)}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=30)

    def stop_all(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(timeout=30)


@contextlib.contextmanager
def running_in_thread(service):
    """A service (bootstrap, provider) whose ``run(ready)`` serves in a thread of this process,
    until the ``with`` block ends; then ``stop()``, and its thread joined."""
    ready = threading.Event()
    thread = threading.Thread(target=service.run, args=(ready,), daemon=True)
    thread.start()
    assert ready.wait(10), "the service did not start within 10 s"
    try:
        yield service
    finally:
        service.stop()
        thread.join(10)


def start_network(procs: Processes, providers: int, ttl: float = 30.0,
                  host: str = "127.0.0.1", bootstrap_args: tuple[str, ...] = (),
                  verbose: bool = False, provider_args: tuple[str, ...] = (),
                  provider_env: dict | None = None) -> tuple[str, list[str]]:
    """A bootstrap (given ``bootstrap_args`` too) and ``providers`` providers (given ``provider_args``
    and ``provider_env`` too: say a ``helpers.hold`` barrier's), all listening on ``host``; returns
    the bootstrap address (with host 0.0.0.0, the one the bootstrap tells other machines to use)
    and provider ids."""
    port = free_port()
    procs.start("bootstrap", *(["-v"] if verbose else []), "bootstrap", "--port", str(port),
                "--state", str(procs.folder / "registry.sqlite"),
                "--ttl", str(ttl), "--host", host, "--relay-port", "0", *bootstrap_args)
    address = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
    ids = []
    for i in range(providers):
        pid = f"p{i}"
        procs.start(pid, "provider", "--bootstrap", address, "--id", pid, "--host", host,
                    "--workdir", str(procs.folder / pid), *provider_args, env=provider_env)
        ids.append(pid)
    for pid in ids:
        procs.wait_for(pid, "registered with")
    return address, ids


def repeated_pairs(pair: Callable[[Path, object, int], dict], args, prefix: str) -> list[dict]:
    """A benchmark's ``args.repeats`` pairs of runs, seeds 90, 91, ..., each in a folder of its own
    under a fresh temporary one (``prefix``); each pair's row printed as one JSON line as it ends."""
    import json
    import tempfile

    root = Path(tempfile.mkdtemp(prefix=prefix))
    rows = []
    for k in range(args.repeats):
        row = pair(root / f"pair-{k}", args, 90 + k)
        rows.append(row)
        print(json.dumps({key: round(value, 4) if isinstance(value, float) else
                          [round(v, 2) for v in value] if isinstance(value, list) else value
                          for key, value in row.items()}), flush=True)
    return rows
