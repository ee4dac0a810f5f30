"""Every listener behaves like the relay's at the process's open-file limit: the dashboard and an
RPC server, each in a real process limited to 64 descriptors, flooded with connections from this
one. accept() failing for want of descriptors pauses the listener with one line per pause (no
traceback per failed accept(), no core spinning on it), and once the connections are gone the
service answers again."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers.waiting import wait_until

from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.channel.rpc import call

LIMIT = 64  # the server process's open-file limit: a flood of this size runs it out
FLOOD = 120  # connections opened at it (more than LIMIT)
PAUSED = "accepting paused for"  # what a listener says when it stops accepting for a moment
SECRET = b"listener-limits"

_LIMITED = f"""
import json, logging, os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, ({LIMIT}, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
"""
_DASHBOARD = _LIMITED + """
from meshlearn.dashboard.server import DashboardServer
server = DashboardServer(lambda: {"kind": "test", "title": "limits"})
server.start()
print(json.dumps({"port": server.port}), flush=True)
sys.stdin.read()
server.stop()
"""
_RPC = _LIMITED + """
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.channel.rpc import RpcServer, call
server = RpcServer("limited", "127.0.0.1", 0, sys.argv[1].encode(), {"ping": lambda request: {"name": "limited"}},
                   keys=KeyPair.generate())
server.start()
# answered once: its serving thread made what it needs (a slow start must not meet the hoard)
call(server.reached_at("127.0.0.1"), "ping", {}, sys.argv[1].encode(), keys=KeyPair.generate())
print(json.dumps({"port": server.port, "address": server.reached_at("127.0.0.1")}), flush=True)
hoard = []
for command in sys.stdin:  # "hoard N": the rest of the process takes every descriptor but N; "free": gives them back
    if command.startswith("hoard"):
        try:
            while True:
                hoard.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            pass
        for _ in range(int(command.split()[1])):
            os.close(hoard.pop())
    else:
        while hoard:
            os.close(hoard.pop())
    print(json.dumps({"hoarded": len(hoard)}), flush=True)
server.stop()
"""


@contextlib.contextmanager
def _limited(script: str, log: Path, *args: str):
    """The server ``script`` in a process of its own (its stderr in ``log``): what it printed on
    start, and the process; killed when the block ends, passed or not."""
    with open(log, "w") as errors:
        child = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=errors, text=True)
    try:
        line = child.stdout.readline()
        assert line, log.read_text()
        yield json.loads(line), child
    finally:
        child.kill()
        child.communicate()


@contextlib.contextmanager
def _flood(port: int):
    """Up to FLOOD connections to ``port``, held (none opened once one is refused: the listener
    stopped listening), closed when the block ends."""
    held: list[socket.socket] = []
    try:
        for _ in range(FLOOD):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break
        yield held
    finally:
        for sock in held:
            sock.close()


def _pause_lines(log: Path, times: int) -> list[str]:
    """The log's lines about pauses, once it holds ``times`` of them (or a traceback: failed)."""
    def said() -> bool:
        text = log.read_text()
        return "Traceback" in text or text.count(PAUSED) >= times
    assert wait_until(said, timeout=30, interval=0.05), f"no {PAUSED!r} line:\n{log.read_text()[:4000]}"
    text = log.read_text()
    assert "Traceback" not in text, text[:4000]
    return [line for line in text.splitlines() if "descriptors" in line or "accept" in line]


def test_a_dashboard_out_of_descriptors_pauses_with_a_line_per_pause_and_serves_again(tmp_path):
    """The flood is held through two pauses (the dashboard holds a silent connection for 10 s):
    two lines, the 1st and 2nd pause, each one line, no traceback; then the page's state again."""
    pytest.importorskip("uvicorn")
    log = tmp_path / "dashboard.log"
    with _limited(_DASHBOARD, log) as (started, _):
        with _flood(started["port"]) as held:
            assert len(held) == FLOOD  # the kernel queues what the dashboard cannot take
            lines = _pause_lines(log, 2)
        assert len(lines) <= 3, lines  # (the 4th pause would be the 3rd line)
        assert all(PAUSED in line and "dashboard: out of descriptors" in line for line in lines), lines
        with urllib.request.urlopen(f"http://127.0.0.1:{started['port']}/api/state", timeout=10) as reply:
            assert json.loads(reply.read()) == {"kind": "test", "title": "limits"}


def test_an_rpc_server_out_of_descriptors_stops_listening_for_a_moment_and_serves_again(tmp_path):
    """A CurveZMQ RPC server (as the bootstrap's, a provider's, a data share's): ZeroMQ would retry
    the failed accept() at once, a core spinning; the server stops listening instead, in one line,
    and a ping is answered once the flood is gone."""
    log = tmp_path / "rpc.log"
    with _limited(_RPC, log, SECRET.decode()) as (started, _):
        with _flood(started["port"]):
            lines = _pause_lines(log, 1)
        assert 1 <= len(lines) <= 3, lines
        assert all(PAUSED in line and "limited: out of descriptors" in line for line in lines), lines
        reply = call(started["address"], "ping", {}, SECRET, timeout=10, keys=KeyPair.generate())
        assert reply.body == {"name": "limited"}


def test_an_rpc_server_with_one_descriptor_left_answers_with_it(tmp_path):
    """The rest of the server's process holds every descriptor but one: a ping takes it and is
    answered (a handler thread started then needs no descriptor of its own to hand its reply
    back: one that did would fail to start and leave the server deaf for good), and so is the
    next one once the descriptors are back."""
    log = tmp_path / "rpc.log"
    with _limited(_RPC, log, SECRET.decode()) as (started, child):
        def command(text: str) -> dict:
            child.stdin.write(text + "\n")
            child.stdin.flush()
            return json.loads(child.stdout.readline())

        assert command("hoard 1")["hoarded"] > 0
        reply = call(started["address"], "ping", {}, SECRET, timeout=10, keys=KeyPair.generate())
        assert reply.body == {"name": "limited"}, log.read_text()
        command("free")
        assert call(started["address"], "ping", {}, SECRET, timeout=10, keys=KeyPair.generate()).body == \
            {"name": "limited"}
        assert "Traceback" not in log.read_text(), log.read_text()
