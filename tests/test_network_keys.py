"""Keys and admission in the network mode: what the bootstrap refuses, and that it changes nothing then.

A real bootstrap (CurveZMQ, its own key pair) serves in a thread; clients are real ZeroMQ
connections with key pairs of their own.
"""

from __future__ import annotations

import logging
import socket
import threading

import pytest
from helpers.netproc import running_in_thread
from helpers.waiting import wait_until

from meshlearn.errors import AuthError, KeyMismatch, KeyRefused, UserInputError
from meshlearn.network.bootstrap.registry import Registry
from meshlearn.network.bootstrap.service import Bootstrap, BootstrapSettings
from meshlearn.network.channel.identity import (
    KeyPair,
    key_text,
    load_or_create_key,
    use_identity,
)
from meshlearn.network.channel.pinning import KnownBootstraps, resolve_bootstrap
from meshlearn.network.channel.rpc import RemoteError, RpcServer, call

SECRET = b"keys-test-secret-0123"


def _two_free_ports() -> int:
    """A port P with P + 1 free too (the bootstrap's relay, where trust on first use asks for the key)."""
    while True:
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue


@pytest.fixture
def bootstrap(tmp_path):
    service = Bootstrap(BootstrapSettings(host="127.0.0.1", port=_two_free_ports(), state=str(tmp_path / "b.sqlite"),
                                          dial_back=False), SECRET, keys=KeyPair.generate())
    with running_in_thread(service):
        yield service


def _register(address: str, provider_id: str, secret: bytes = SECRET):
    return call(address, "register", {"id": provider_id, "address": "127.0.0.1:5000", "ram_gb": 1, "cores": 1,
                                      "device": "cpu"}, secret, timeout=5, sender=provider_id)


def _ids(bootstrap: Bootstrap) -> list[str]:
    return sorted(p.id for p in bootstrap.registry.providers())


def test_a_refused_key_is_said_even_when_the_handshake_fails_before_the_request_is_sent(bootstrap, caplog,
                                                                                      monkeypatch):
    """The request is held between the connection and its sending until the server has refused the
    key: the call still ends within its timeout, naming the refusal, and never blocks in its send
    (a send is bounded by the call's timeout: a run under load once blocked there for 300 s)."""
    from meshlearn.network.channel import rpc

    revoked = KeyPair.generate()
    use_identity(revoked)
    _register(bootstrap.address, "p-revoked")
    outside = Registry(bootstrap.settings.state).open()  # what `meshlearn revoke` does
    outside.revoke(revoked.text)
    outside.close()
    sealed = rpc.seal

    def held_until_refused(*args, **kwargs):  # sealing is the step between connect and send
        wait_until(lambda: any("revoked key" in r.getMessage() for r in caplog.records), timeout=20)
        return sealed(*args, **kwargs)

    monkeypatch.setattr(rpc, "seal", held_until_refused)
    outcome: list[BaseException] = []

    def ping() -> None:
        try:
            call(bootstrap.address, "ping", {}, SECRET, timeout=3)
        except BaseException as exc:  # noqa: BLE001 - the test reads what the call raised
            outcome.append(exc)

    with caplog.at_level(logging.WARNING):
        pinger = threading.Thread(target=ping, daemon=True)
        pinger.start()
        pinger.join(timeout=30)
    assert not pinger.is_alive(), "the call blocked in its send after the key was refused"
    assert len(outcome) == 1 and isinstance(outcome[0], KeyRefused), outcome


def test_registration_records_the_key_and_discovery_vouches_for_it(bootstrap):
    me = KeyPair.generate()
    use_identity(me)
    _register(bootstrap.address, "p1")
    found = call(bootstrap.address, "discover", {"count": 5}, SECRET, timeout=5).body["providers"]
    assert [p["address"] for p in found] == [f"127.0.0.1:5000@{me.text}"]
    use_identity(KeyPair.generate())  # another key cannot speak for p1
    with pytest.raises(RemoteError, match="registered with another key"):
        call(bootstrap.address, "leave", {"id": "p1"}, SECRET, timeout=5)
    with pytest.raises(RemoteError, match="registered with another key"):
        _register(bootstrap.address, "p1")
    assert _ids(bootstrap) == ["p1"] and bootstrap.registry.key_of("p1") == me.text


def test_a_key_without_the_network_secret_is_refused_and_changes_nothing(bootstrap, caplog):
    use_identity(KeyPair.generate())
    with caplog.at_level(logging.WARNING), pytest.raises(AuthError, match="different secret"):
        _register(bootstrap.address, "intruder", secret=b"not-the-network-secret")
    assert _ids(bootstrap) == []
    assert any("rejected a request" in r.getMessage() and "signature does not match" in r.getMessage()
               for r in caplog.records)


def test_a_revoked_key_is_refused_on_its_next_connection(bootstrap, tmp_path, caplog):
    revoked, other = KeyPair.generate(), KeyPair.generate()
    use_identity(revoked)
    _register(bootstrap.address, "p-revoked")
    use_identity(other)
    _register(bootstrap.address, "p-other")
    outside = Registry(bootstrap.settings.state).open()  # what `meshlearn revoke` does, from another process
    assert outside.revoke(revoked.text) == ["p-revoked"]
    outside.close()
    use_identity(revoked)
    with caplog.at_level(logging.WARNING), pytest.raises(KeyRefused, match="revoked"):
        call(bootstrap.address, "ping", {}, SECRET, timeout=5)
    with pytest.raises(KeyRefused):
        _register(bootstrap.address, "p-revoked")
    assert _ids(bootstrap) == ["p-other"]
    assert any("revoked key" in r.getMessage() for r in caplog.records)
    use_identity(other)  # everyone else is served as before, and told which key is out
    beat = call(bootstrap.address, "heartbeat", {"id": "p-other", "status": "free"}, SECRET, timeout=5).body
    assert beat["revoked"] == [revoked.text]


def test_a_server_holding_another_key_is_refused_before_anything_is_sent(bootstrap, tmp_path):
    seen = []
    impostor = RpcServer("impostor", "127.0.0.1", 0, SECRET, {"register": lambda req: seen.append(req) or {}},
                         keys=KeyPair.generate())
    impostor.start()
    try:
        pinned_to_real = f"127.0.0.1:{impostor.port}@{bootstrap.keys.text}"
        with pytest.raises(KeyMismatch, match="closed during the encrypted handshake .* holds another key"):
            _register(pinned_to_real, "p1")
        assert seen == [] and wait_until(lambda: impostor.failed_handshakes >= 1, timeout=5)
        # the same through a known-bootstraps file: the recorded key wins, the command says what to do
        known = KnownBootstraps(tmp_path / "known")
        known.remember(f"127.0.0.1:{impostor.port}", bootstrap.keys.public)
        with pytest.raises(UserInputError, match="remove the line for 127.0.0.1"):
            resolve_bootstrap(f"127.0.0.1:{impostor.port}", SECRET, known, print)
    finally:
        impostor.stop()


def test_trust_on_first_use_records_the_announced_key_with_a_warning(bootstrap, tmp_path):
    said = []
    known = KnownBootstraps(tmp_path / "known")
    plain = bootstrap.server.address
    assert resolve_bootstrap(plain, SECRET, known, said.append) == bootstrap.address
    assert "trusting the bootstrap" in said[0] and bootstrap.keys.text in said[0]
    assert known.get(plain) == bootstrap.keys.public
    said.clear()
    assert resolve_bootstrap(plain, SECRET, known, said.append) == bootstrap.address and said == []


class _Recorder:
    """A TCP proxy for one connection that keeps the bytes the client sent."""

    def __init__(self, upstream: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = upstream
        self.sent = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream))

        def copy(src, dst, keep):
            try:
                while data := src.recv(65536):
                    keep.extend(data)
                    dst.sendall(data)
            except OSError:  # the other direction closed both sockets first
                pass
            dst.close()
        threading.Thread(target=copy, args=(server, client, bytearray()), daemon=True).start()
        copy(client, server, self.sent)


def test_a_replayed_or_truncated_handshake_gets_nowhere(bootstrap, caplog):
    use_identity(KeyPair.generate())
    recorder = _Recorder(bootstrap.server.port)
    _register(f"127.0.0.1:{recorder.port}@{bootstrap.keys.text}", "p-recorded")
    assert wait_until(lambda: len(recorder.sent) > 200, timeout=5)
    call(bootstrap.address, "leave", {"id": "p-recorded"}, SECRET, timeout=5)
    assert _ids(bootstrap) == []
    captured = bytes(recorder.sent)
    caplog.set_level(logging.WARNING)
    for attempt in (captured, captured[: len(captured) // 2], captured[:40]):
        with socket.create_connection(("127.0.0.1", bootstrap.server.port), timeout=5) as raw:
            raw.sendall(attempt)
            raw.settimeout(2)
            try:
                while raw.recv(65536):  # the server answers the greeting, then drops the connection
                    pass
            except (TimeoutError, ConnectionResetError):
                pass
    assert _ids(bootstrap) == []  # the replayed register did not register anything
    assert call(bootstrap.address, "ping", {}, SECRET, timeout=5).body == {"service": "bootstrap", "id": None}
    assert bootstrap.server.failed_handshakes >= 1
    assert any("refused a connection" in r.getMessage() and "replayed, truncated" in r.getMessage()
               for r in caplog.records)


def test_a_key_file_is_made_private_and_one_others_can_read_is_refused(tmp_path):
    path = tmp_path / "keys" / "provider.key"
    made, new = load_or_create_key(path)
    assert new and path.stat().st_mode & 0o777 == 0o600
    again, new = load_or_create_key(path)
    assert not new and again == made and key_text(made.public) == made.text
    path.chmod(0o644)
    with pytest.raises(UserInputError, match="chmod 600"):
        load_or_create_key(path)
    path.chmod(0o600)
    path.write_text("garbage\n")
    with pytest.raises(UserInputError, match="not a meshlearn key file"):
        load_or_create_key(path)


def test_meshlearn_revoke_shuts_a_key_out_of_a_running_bootstrap(bootstrap):
    import subprocess
    import sys

    revoked = KeyPair.generate()
    use_identity(revoked)
    _register(bootstrap.address, "p-cli")
    # "--": a printed key may start with '-' (1 in 64), which argparse would take for a flag
    done = subprocess.run([sys.executable, "-m", "meshlearn", "revoke", "--state", bootstrap.settings.state, "--",
                           revoked.text], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and "p-cli" in done.stdout, done.stdout + done.stderr
    with pytest.raises(KeyRefused):
        call(bootstrap.address, "ping", {}, SECRET, timeout=5)
    assert _ids(bootstrap) == []
    bad = subprocess.run([sys.executable, "-m", "meshlearn", "revoke", "not-a-key", "--state",
                          bootstrap.settings.state], capture_output=True, text=True, timeout=60, check=False)
    assert bad.returncode == 2 and "not a meshlearn public key" in bad.stderr and "Traceback" not in bad.stderr
