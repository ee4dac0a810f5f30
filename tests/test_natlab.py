"""Self-test of tests/helpers/natlab.py: the namespaces really behave like homes behind NAT routers."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

import pytest
from helpers import natlab
from helpers.natlab import NatLab, Sniffer, natlab_available

PORT = 7000

# Accepts connections forever; for each one prints "PEER_IP BYTES_RECEIVED" once the client closes.
SERVER = r"""
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(16)
print("ready", flush=True)
while True:
    c, addr = s.accept()
    c.settimeout(5)
    n = 0
    try:
        while chunk := c.recv(65536):
            n += len(chunk)
    except OSError:
        pass
    c.close()
    print(addr[0], n, flush=True)
"""

# Connects, sends the payload (hex), closes; prints "ok" or "fail ERROR" and exits 0 or 1.
CLIENT = r"""
import socket, sys
host, port, payload, timeout = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), float(sys.argv[4])
try:
    c = socket.create_connection((host, port), timeout=timeout)
    c.sendall(payload)
    c.close()
except OSError as e:
    print("fail", type(e).__name__, e, flush=True)
    sys.exit(1)
print("ok", flush=True)
"""


@pytest.fixture(scope="module")
def lab():
    reason = natlab_available()
    if reason:
        pytest.skip(reason)
    with NatLab(homes=2) as lab:
        yield lab


def read_line(proc: subprocess.Popen, timeout: float = 5.0) -> str:
    """One line of the process's stdout, or fail after ``timeout`` seconds."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "no output from the process in time"
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def serving(lab: NatLab, ns: str, host: str, port: int = PORT):
    """A TCP server listening on host:port inside namespace ``ns``; always killed afterwards."""
    proc = subprocess.Popen(lab.command(ns, [sys.executable, "-c", SERVER, host, str(port)]),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert read_line(proc) == "ready"
        yield proc
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def connect(lab: NatLab, ns: str, host: str, payload: bytes = b"hello", port: int = PORT,
            timeout: float = 1.0) -> tuple[bool, str]:
    """Connect from namespace ``ns`` to host:port and send ``payload``; (succeeded, client output)."""
    done = subprocess.run(lab.command(ns, [sys.executable, "-c", CLIENT, host, str(port), payload.hex(),
                                           str(timeout)]),
                          check=False, capture_output=True, text=True, timeout=timeout + 10)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def test_home_reaches_public_service_through_nat(lab):
    with serving(lab, "pub", lab.public_ip) as server:
        ok, out = connect(lab, "h1", lab.public_ip)
        assert ok, out
        assert read_line(server) == f"{lab.router_ip(1)} 5"


def test_public_service_sees_masqueraded_router_address(lab):
    with serving(lab, "pub", lab.public_ip) as server:
        ok, out = connect(lab, "h2", lab.public_ip)
        assert ok, out
        peer = read_line(server).split()[0]
        assert peer == "198.18.2.2" and peer != lab.home_ip(2)


def test_pub_cannot_connect_into_a_home(lab):
    with serving(lab, "h1", lab.home_ip(1)):
        ok, out = connect(lab, "r1", lab.home_ip(1))  # the server is up: its own router reaches it
        assert ok, out
        ok, out = connect(lab, "pub", lab.home_ip(1))  # no route
        assert not ok, out
        # Even with a route to the home network, router 1's firewall drops new incoming connections.
        natlab._run(["ip", "-n", lab.ns("pub"), "route", "add", "10.1.0.0/24", "via", lab.router_ip(1)])
        try:
            ok, out = connect(lab, "pub", lab.home_ip(1), timeout=0.5)
            assert not ok, out
        finally:
            natlab._run(["ip", "-n", lab.ns("pub"), "route", "del", "10.1.0.0/24"])


def test_home_cannot_connect_to_another_home(lab):
    with serving(lab, "h1", lab.home_ip(1)):
        ok, out = connect(lab, "h2", lab.home_ip(1), timeout=0.5)
        assert not ok, out


def test_socket_of_this_process_in_a_home(lab):
    own_namespace = os.readlink("/proc/thread-self/ns/net")
    with serving(lab, "pub", lab.public_ip) as server:
        with lab.socket("h2") as sock:
            sock.settimeout(2)
            sock.connect((lab.public_ip, PORT))
            assert sock.getsockname()[0] == lab.home_ip(2)
            sock.sendall(b"abc")
        assert read_line(server) == f"{lab.router_ip(2)} 3"
    assert os.readlink("/proc/thread-self/ns/net") == own_namespace


def test_sniffer_in_pub_sees_payload_from_home(lab):
    payload, elsewhere = os.urandom(64), os.urandom(64)
    with serving(lab, "pub", lab.public_ip) as server, serving(lab, "h1", lab.home_ip(1)) as home_server:
        with Sniffer(lab, "pub") as sniffer:
            ok, out = connect(lab, "h2", lab.public_ip, payload)
            assert ok, out
            assert read_line(server) == f"{lab.router_ip(2)} 64"
            ok, out = connect(lab, "r1", lab.home_ip(1), elsewhere)  # never crosses pub
            assert ok, out
            assert read_line(home_server) == "10.1.0.1 64"
            time.sleep(0.05)
        data = sniffer.data()
    assert sniffer.packets > 0 and len(data) > 0
    assert sniffer.dropped == 0 and sniffer.kernel_drops == 0
    assert payload in data
    assert elsewhere not in data


def test_close_kills_processes_and_deletes_namespaces():
    reason = natlab_available()
    if reason:
        pytest.skip(reason)
    lab = NatLab(homes=1)
    names = [lab.ns(n) for n in ("pub", "r1", "h1")]
    proc = subprocess.Popen(lab.command("h1", ["sleep", "60"]), start_new_session=True)
    try:
        lab.close()
        assert proc.wait(timeout=5) == -signal.SIGKILL
        lab.close()  # idempotent
        assert not set(names) & set(os.listdir(natlab.NETNS_DIR))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_failed_setup_cleans_up(monkeypatch):
    reason = natlab_available()
    if reason:
        pytest.skip(reason)
    real_run = natlab._run

    def failing_run(argv, *args, **kwargs):
        if "nft" in argv:
            raise RuntimeError("natlab: command failed: nft: injected")
        return real_run(argv, *args, **kwargs)

    def ours() -> set[str]:
        return {n for n in os.listdir(natlab.NETNS_DIR) if n.startswith(f"ml{os.getpid() % 1000}-")}

    before = ours()
    monkeypatch.setattr(natlab, "_run", failing_run)
    with pytest.raises(RuntimeError, match="nft"):
        NatLab(homes=2)
    assert ours() == before
