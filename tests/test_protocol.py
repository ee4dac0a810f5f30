"""The network's protocol, declared once (``network/protocol``): a request is one declaration and one
handler, called through a typed stub from the other side, listed in the generated pages; every body
is validated into its model at the edge; both ends state their protocol version at the handshake
and refuse another in one line."""

from __future__ import annotations

import textwrap
from typing import Annotated

import pytest
from pydantic import Field

from meshlearn.errors import BadMessage, ProtocolMismatch, RemoteError
from meshlearn.network.channel import handshake
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.message import Message, TaskId
from meshlearn.network.protocol.rpcs import RPCS, Caller, Rpc, Server
from meshlearn.network.protocol.serving import ask, ask_with_blobs, serve
from tests.helpers.netproc import SECRET, Processes, free_port

SECRET_BYTES = SECRET.encode()


class Shout(Message):
    """The test's request: a task's id and a word to shout."""

    task: TaskId
    word: Annotated[str, Field(min_length=1, max_length=16)]
    times: Annotated[int, Field(ge=1, le=3)] = 1


class Shouted(Message):
    loud: str


SHOUT = Rpc("task.shout", Server.PROVIDER, Shout, Shouted, Caller.TASK_PROVIDER, "that task",
            "shouts a word back, for this test", blobs_out=(1, 1))


def _shout(message: Shout, request) -> tuple[Shouted, list]:
    return Shouted(loud=" ".join([message.word.upper()] * message.times)), [message.word.encode()]


@pytest.fixture
def shout_server(monkeypatch):
    """A server over CurveZMQ answering the one new declaration, registered among every other."""
    monkeypatch.setattr(rpcs, "RPCS", (*RPCS, SHOUT))
    server = RpcServer("provider", "127.0.0.1", 0, SECRET_BYTES, serve(Server.PROVIDER, {SHOUT: _shout}, (SHOUT,)),
                       keys=KeyPair.generate())
    server.start()
    try:
        yield f"127.0.0.1:{server.port}@{server.keys.text}"
    finally:
        server.stop()


def test_a_new_request_is_one_declaration_one_handler_and_a_typed_call(shout_server):
    client = KeyPair.generate()
    reply, blobs = ask_with_blobs(shout_server, SHOUT, Shout(task="t1", word="hey", times=2), SECRET_BYTES,
                                  keys=client)
    assert reply == Shouted(loud="HEY HEY") and [bytes(b) for b in blobs] == [b"hey"]
    assert ask(shout_server, SHOUT, Shout(task="t1", word="a"), SECRET_BYTES, keys=client).loud == "A"


def test_the_new_request_is_in_both_generated_pages(shout_server):
    assert "| `task.shout` | provider | one of the task's providers" in rpcs.authorization_table()
    row = next(line for line in rpcs.message_list().splitlines() if "`task.shout`" in line)
    assert "Shout: task, word, times?" in row and "Shouted: loud" in row and "0 / 1" in row


@pytest.mark.parametrize("body, problem", [
    ({"task": "t1"}, "field 'word': Field required"),
    ({"task": "t1", "word": "x", "extra": 1}, "field 'extra': Extra inputs are not permitted"),
    ({"task": "t1", "word": "x", "times": "2"}, "field 'times': Input should be a valid integer"),
    ({"task": "t1", "word": "x", "times": True}, "field 'times': Input should be a valid integer"),
    ({"task": "t1", "word": "x" * 17}, "field 'word': String should have at most 16 characters"),
    ({"task": "../etc", "word": "x"}, "field 'task': String should match pattern"),
])
def test_a_body_that_does_not_fit_its_declaration_is_refused_in_one_line(shout_server, body, problem):
    with pytest.raises(RemoteError) as refused:
        call(shout_server, "task.shout", body, SECRET_BYTES, keys=KeyPair.generate())
    assert str(refused.value).startswith(f"task.shout: {problem}") and "\n" not in str(refused.value)


def test_a_stub_takes_only_its_declared_request_and_refuses_a_reply_that_does_not_fit(monkeypatch):
    monkeypatch.setattr(rpcs, "RPCS", (*RPCS, SHOUT))
    with pytest.raises(TypeError, match="task.shout takes Shout, not Shouted"):
        ask("127.0.0.1:9", SHOUT, Shouted(loud="x"), SECRET_BYTES)
    wrong = RpcServer("provider", "127.0.0.1", 0, SECRET_BYTES,
                      {"task.shout": lambda request: ({"loud": 5}, [b"x"])})  # another release's reply, say
    wrong.start()
    try:
        with pytest.raises(BadMessage, match=r"the reply to task.shout from 127.0.0.1:\d+: field 'loud'"):
            ask(f"127.0.0.1:{wrong.port}", SHOUT, Shout(task="t", word="w"), SECRET_BYTES)
    finally:
        wrong.stop()


def test_serve_refuses_a_handler_without_a_declaration_and_a_declaration_without_a_handler(monkeypatch):
    provider = {rpc: _shout for rpc in rpcs.served_by(Server.PROVIDER)}
    with pytest.raises(rpcs.UndeclaredRpc, match=r"undeclared \['task.shout'\], without a handler none"):
        serve(Server.PROVIDER, {**provider, SHOUT: _shout})
    del provider[rpcs.TASK_JOIN]
    with pytest.raises(rpcs.UndeclaredRpc, match=r"undeclared none, without a handler \['task.join'\]"):
        serve(Server.PROVIDER, provider)


def test_a_changed_message_without_a_new_protocol_version_fails_here():
    assert rpcs.protocol_digest() == rpcs.PROTOCOL_DIGEST, (
        "a declared message or request changed: bump the request's version and "
        "meshlearn.network.channel.handshake.PROTOCOL_VERSION, then set PROTOCOL_DIGEST in "
        f"meshlearn/network/protocol/rpcs.py to {rpcs.protocol_digest()!r}")
    changed = (*RPCS[:-1], Rpc(**{**RPCS[-1].__dict__, "version": RPCS[-1].version + 1}))
    assert rpcs.protocol_digest(changed) != rpcs.PROTOCOL_DIGEST


@pytest.mark.parametrize("server_version, client_version, upgrade", [(2, 1, "on this client"), (2, 3, "on 127.0.0.1")])
def test_a_client_and_a_server_of_two_protocol_versions_refuse_each_other_in_one_line(server_version, client_version,
                                                                                      upgrade):
    server = RpcServer("bootstrap", "127.0.0.1", 0, SECRET_BYTES, {"ping": lambda request: {"service": "bootstrap"}},
                       keys=KeyPair.generate(), protocol=server_version)
    server.start()
    try:
        with pytest.raises(ProtocolMismatch) as refused:
            call(f"127.0.0.1:{server.port}@{server.keys.text}", "ping", {}, SECRET_BYTES, keys=KeyPair.generate(),
                 protocol=client_version)
        line = str(refused.value)
        assert f"speaks meshlearn protocol {server_version}" in line and f"speaks protocol {client_version}" in line
        assert f"upgrade meshlearn {upgrade}" in line and "\n" not in line
        assert server.rejected == 1  # the server refused the request too, before any handler saw it
    finally:
        server.stop()


def test_a_server_refuses_a_client_that_states_no_version_as_an_older_release():
    assert handshake.stated_version("") == handshake.UNSTATED == 1
    assert handshake.stated_version("x1") is None and handshake.stated_version("3") == 3
    refusal = handshake.mismatch(2, "", "", "the caller at 10.0.0.5", "this bootstrap")
    assert "the caller at 10.0.0.5 speaks meshlearn protocol 1, this bootstrap speaks protocol 2" in str(refusal)
    assert "upgrade meshlearn on the caller at 10.0.0.5" in str(refusal)
    assert handshake.mismatch(2, "2", "0.1.0", "x", "y") is None


def _older_release(folder) -> dict:
    """The environment of a `meshlearn` process that states protocol 1 at its handshakes, as the
    releases before the protocol was versioned would (a sitecustomize runs before anything else)."""
    (folder / "sitecustomize.py").write_text(textwrap.dedent("""
        import meshlearn.network.channel.handshake as handshake
        handshake.PROTOCOL_VERSION = 1
    """))
    return {"PYTHONPATH": str(folder)}


def test_a_provider_of_another_protocol_version_is_refused_by_the_bootstrap_and_says_so(tmp_path):
    procs = Processes(tmp_path)
    try:
        port = free_port()
        procs.start("bootstrap", "bootstrap", "--port", str(port), "--state", str(tmp_path / "r.sqlite"),
                    "--host", "127.0.0.1", "--relay-port", "0")
        address = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
        old = tmp_path / "old"
        old.mkdir()
        provider = procs.start("p0", "provider", "--bootstrap", address, "--id", "p0", "--host", "127.0.0.1",
                               "--workdir", str(tmp_path / "p0"), env=_older_release(old))
        assert provider.wait(timeout=60) != 0
        said = procs.log("p0")
        assert f"speaks meshlearn protocol {handshake.PROTOCOL_VERSION}" in said and "speaks protocol 1" in said, said
        assert "upgrade meshlearn on this client" in said and "Traceback" not in said, said
        procs.wait_for("bootstrap", r"the caller at 127\.0\.0\.1 speaks meshlearn protocol 1")
    finally:
        procs.stop_all()


def test_the_refusal_names_this_release():
    assert handshake.release() != "unknown" and f"(meshlearn {handshake.release()})" in str(
        handshake.mismatch(2, "1", "", "a", "b"))
