"""Issue 32: what strangers and insiders make the relay hold, and whether it still serves.

One Relay in this process (its threads and descriptors are what is counted; the client sockets
this script opens are subtracted), an echo server behind an agent in a child process. Steps:
100 allocations under fresh keys (an insider's keys cost nothing), one agent, then 300 held
connections (100 silent at the agent port; 100 silent and 100 that sent a ZeroMQ greeting and
went quiet at an allocation's public port), and 20 echo exchanges through that allocation while
they are held.

    python benchmarks/relay_load.py              # this tree's relay
    python benchmarks/relay_load.py --git REV    # the relay of a git revision (e.g. 8edf5df, before issue 32)

Run both, one after the other on one machine, to compare.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ZMTP_GREETING = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)


OLD_RELAY = "src/meshlearn/network/relay.py"  # the relay, one module, before network/ was split into packages
MOVED = {"meshlearn.network.sparselog": "meshlearn.sparselog",  # what the old relay imports, and where it is now
         "meshlearn.network.addresses": "meshlearn.network.channel.addresses",
         "meshlearn.network.envelope": "meshlearn.network.channel.envelope",
         "meshlearn.network.splicer": "meshlearn.network.channel.splicer"}


def relay_classes(revision: str | None) -> tuple[type, type]:
    """(Relay, RelayAgent), from this tree or from a git revision from before network/ was split
    into packages, when the relay was one module (its imports adjusted to where those modules
    live now)."""
    if revision is None:
        from meshlearn.network.channel.relay import Relay
        from meshlearn.network.channel.relayagent import RelayAgent
        return Relay, RelayAgent
    shown = subprocess.run(["git", "show", f"{revision}:{OLD_RELAY}"], capture_output=True, text=True, check=False,
                           cwd=Path(__file__).resolve().parents[1])
    if shown.returncode != 0:
        sys.exit(f"{revision} has no {OLD_RELAY}: --git measures a revision from before network/ had packages; "
                 "to measure a later one, check it out and run this script there")
    text = shown.stdout
    for old, new in MOVED.items():
        text = text.replace(f"from {old} import", f"from {new} import")
    path = Path(tempfile.mkdtemp()) / "relay_at_revision.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("relay_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module.Relay, module.RelayAgent


def _echo_server(port_out) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_out.put(listener.getsockname()[1])
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=lambda c=conn: [c.sendall(d) for d in iter(lambda: c.recv(65536), b"")],
                         daemon=True).start()


def _count(label: str, own_sockets: int = 0) -> None:
    time.sleep(1.0)
    descriptors = len(os.listdir("/proc/self/fd")) - own_sockets
    print(f"{label:58s} threads {threading.active_count():4d}  descriptors {descriptors:5d}", flush=True)


def _exchange(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=3) as sock:
            sock.sendall(b"ping")
            sock.settimeout(3)
            return sock.recv(10) == b"ping"
    except OSError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--git", help="measure the relay of this git revision instead of this tree's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the relay's warnings about each cap it hits: not what is measured
    Relay, RelayAgent = relay_classes(args.git)
    print(f"relay: {args.git or 'this tree'}; {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    ports = mp.Queue()
    mp.Process(target=_echo_server, args=(ports,), daemon=True).start()
    echo = ports.get()
    _count("before")
    relay = Relay("127.0.0.1", 0, "127.0.0.1", key_line="K")
    relay.start()
    _count("relay started")
    with_source = "source" in inspect.signature(Relay.allocate).parameters
    publics = []
    for i in range(100):
        try:
            owner = f"key-{i}"
            publics.append(relay.allocate(owner, f"10.0.0.{i}") if with_source else relay.allocate(owner))
        except Exception as exc:  # noqa: BLE001 - a cap: that is what is measured
            print(f"  allocation {i} refused: {exc}")
            break
    _count(f"{len(publics)} allocations, a fresh key each")
    token, public = publics[0]
    agent = RelayAgent(relay.address, token, f"127.0.0.1:{echo}")
    agent.start()
    _count("+ one agent for allocation 0")
    held = []
    for address, greeting in [(relay.address, False)] * 100 + [(public, False)] * 100 + [(public, True)] * 100:
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        if greeting:
            sock.sendall(ZMTP_GREETING)
        held.append(sock)
    _count("+ 300 held connections (100 agent port, 200 allocation 0)", len(held))
    served = sum(_exchange(public) for _ in range(20))
    print(f"echo exchanges through allocation 0 while they are held: {served}/20", flush=True)
    for sock in held:
        sock.close()
    agent.stop()
    relay.stop()
    _count("after stop")


if __name__ == "__main__":
    sys.exit(main())
