"""The etcd client (JSON gateway) and the etcd member launcher a replicated bootstrap registry uses:
against real etcd members on loopback (skipped where etcd is not installed), and against tiny local
HTTP servers that answer what etcd never would, hang, or break off."""

import base64
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from helpers.etcdlab import READY, member_specs, needs_etcd, start_members, stop_members
from helpers.netproc import free_port

from meshlearn.errors import ConfigError
from meshlearn.network.bootstrap import etcd
from meshlearn.network.bootstrap.etcd import (
    AmbiguousCommit,
    Delete,
    EtcdClient,
    EtcdRefused,
    EtcdTls,
    EtcdUnavailable,
    Put,
    mod_revision_is,
    none_modified_since,
    prefix_end,
)
from meshlearn.network.bootstrap.etcdcluster import (
    EtcdMember,
    EtcdMemberFailed,
    client_urls,
    make_cluster_certs,
    member_tls,
)

HELD = 30.0  # seconds a fake endpoint holds an answer back at most (the test releases it sooner)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One etcd member on plain HTTP, and its client URL."""
    specs = member_specs(tmp_path_factory.mktemp("single"), 1)
    members = start_members(specs, None)
    try:
        yield specs[0].client_url()
    finally:
        stop_members(members)


@pytest.fixture
def no_pause(monkeypatch):
    """No pause between two passes over the endpoints (they fail at once here, and stay failed)."""
    monkeypatch.setattr(etcd, "PASS_PAUSE", 0.0)


@pytest.fixture
def client(single):
    made = EtcdClient([single])
    yield made
    made.close()


# -- one member, plain HTTP -----------------------------------------------------------------------

@needs_etcd
def test_put_get_and_range_by_prefix(client):
    succeeded, revision = client.txn([], [Put(b"t1/b", b"2"), Put(b"t1/a", b"1"), Put(b"t1b", b"not under t1/")])
    assert succeeded and revision > 0
    found = client.get(b"t1/a")
    assert (found.key, found.value, found.mod_revision, found.create_revision, found.version) == \
        (b"t1/a", b"1", revision, revision, 1)
    assert client.get(b"t1/missing") is None
    kvs, read_at = client.range(b"t1/")
    assert [(kv.key, kv.value) for kv in kvs] == [(b"t1/a", b"1"), (b"t1/b", b"2")]
    assert read_at == revision
    client.txn([], [Put(b"t1/a", b"")])
    assert client.get(b"t1/a").value == b"" and client.get(b"t1/a").version == 2


@needs_etcd
def test_range_reads_at_a_past_revision(client):
    _, first = client.txn([], [Put(b"t2/k", b"old")])
    client.txn([], [Put(b"t2/k", b"new"), Put(b"t2/added", b"x")])
    kvs, _ = client.range(b"t2/", first)
    assert [(kv.key, kv.value) for kv in kvs] == [(b"t2/k", b"old")]
    assert [kv.value for kv in client.range(b"t2/")[0]] == [b"x", b"new"]


@needs_etcd
def test_a_large_range_is_read_in_pages_at_one_revision(client, monkeypatch):
    monkeypatch.setattr(etcd, "RANGE_PAGE", 2)
    client.txn([], [Put(b"t3/%d" % i, b"v") for i in range(5)])
    pages = []
    writer = EtcdClient(client.endpoints)
    real_call = client._call

    def write_after_first_page(*args, **kwargs):
        answer = real_call(*args, **kwargs)
        pages.append(answer)
        if len(pages) == 1:  # between two pages: change a key still to be read, and add one
            writer.txn([], [Put(b"t3/4", b"changed"), Put(b"t3/9", b"added")])
        return answer

    monkeypatch.setattr(client, "_call", write_after_first_page)
    kvs, _ = client.range(b"t3/")
    writer.close()
    assert len(pages) == 3
    assert [(kv.key, kv.value) for kv in kvs] == [(b"t3/%d" % i, b"v") for i in range(5)]


@needs_etcd
def test_mod_revision_is_guards_a_write(client):
    create = [mod_revision_is(b"t4/k", 0)]  # the key does not exist yet
    assert client.txn(create, [Put(b"t4/k", b"first")])[0]
    assert client.txn(create, [Put(b"t4/k", b"second")], [Put(b"t4/lost", b"yes")])[0] is False
    assert client.get(b"t4/k").value == b"first" and client.get(b"t4/lost").value == b"yes"
    seen = client.get(b"t4/k").mod_revision
    assert client.txn([mod_revision_is(b"t4/k", seen)], [Put(b"t4/k", b"third")])[0]
    assert client.txn([mod_revision_is(b"t4/k", seen)], [Put(b"t4/k", b"stale")])[0] is False
    assert client.get(b"t4/k").value == b"third"


@needs_etcd
def test_none_modified_since_guards_a_prefix(client):
    assert client.txn([none_modified_since(b"t5/", 0)], [])[0]  # no key under it: nothing changed
    client.txn([], [Put(b"t5/a", b"1"), Put(b"t5/b", b"1")])
    _, read_at = client.range(b"t5/")
    client.txn([], [Put(b"t5-other", b"1")])  # outside the prefix
    assert client.txn([none_modified_since(b"t5/", read_at)], [Put(b"t5/c", b"1")])[0]
    assert client.txn([none_modified_since(b"t5/", read_at)], [Put(b"t5/d", b"1")])[0] is False  # t5/c is newer
    assert client.get(b"t5/d") is None


@needs_etcd
def test_delete_one_key_or_a_prefix(client):
    client.txn([], [Put(b"t6/a", b"1"), Put(b"t6/b/c", b"1"), Put(b"t6/b/d", b"1"), Put(b"t6b", b"1")])
    client.txn([], [Delete(b"t6/a")])
    assert [kv.key for kv in client.range(b"t6/")[0]] == [b"t6/b/c", b"t6/b/d"]
    client.txn([], [Delete(b"t6/", prefix=True)])
    assert client.range(b"t6/")[0] == [] and client.get(b"t6b") is not None


@needs_etcd
def test_a_request_etcd_refuses_is_not_retried(client):
    with pytest.raises(EtcdRefused, match="future revision"):
        client.range(b"t7/", 10**9)
    with pytest.raises(EtcdRefused, match="too many operations"):
        client.txn([], [Put(b"t7/%d" % i, b"") for i in range(1000)])


@needs_etcd
def test_status_and_leader_of_one_member(client, single):
    status = client.status(single)
    assert status["member_id"] == status["leader"] != 0 and status["raft_term"] >= 1
    assert client.leader_endpoint() == single


@needs_etcd
def test_an_endpoint_that_answers_garbage_is_skipped_for_reads(client, single):
    with _FakeEndpoint(lambda request: request.answer(200, b"garbage")) as broken:
        client.txn([], [Put(b"t8/k", b"v")])
        both = EtcdClient([broken.url, single])
        assert both.get(b"t8/k").value == b"v"
        assert len(broken.seen) == 1
        both.close()


# -- three members with TLS -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory):
    """Three members that accept only clients and peers with certificates of their CA: (members,
    their client URLs, the client's TLS files, the certificates' folder)."""
    root = tmp_path_factory.mktemp("tls")
    client_tls = make_cluster_certs(root / "certs", ["127.0.0.1"])
    specs = member_specs(root, 3)
    members = start_members(specs, member_tls(root / "certs"))
    try:
        yield members, client_urls(specs, tls=True), client_tls, root
    finally:
        stop_members(members)


@needs_etcd
def test_a_write_through_one_member_is_read_through_another(tls_cluster):
    _, urls, tls, _ = tls_cluster
    first, third = EtcdClient([urls[0]], tls), EtcdClient([urls[2]], tls)
    first.txn([], [Put(b"tls/k", b"v")])
    assert third.get(b"tls/k").value == b"v"
    first.close()
    third.close()


@needs_etcd
def test_a_client_without_the_clusters_certificate_is_refused(tls_cluster, tmp_path, no_pause):
    _, urls, tls, _ = tls_cluster
    other = make_cluster_certs(tmp_path / "other", ["127.0.0.1"])
    for wrong, says in [(EtcdTls(tls.ca), "refused this client's TLS certificate"),
                        (EtcdTls(tls.ca, other.cert, other.key), "refused this client's TLS certificate"),
                        (EtcdTls(other.ca, other.cert, other.key), "not one the cluster's CA signed")]:
        client = EtcdClient(urls[:1], wrong, deadline=3.0)
        with pytest.raises(EtcdUnavailable, match=says) as refused:
            client.get(b"tls/k")
        with pytest.raises(EtcdUnavailable, match=says) as refused_write:
            client.txn([], [Put(b"tls/never", b"v")])
        assert not isinstance(refused_write.value, AmbiguousCommit)  # the member never read it
        assert "\n" not in str(refused.value)
        client.close()
    right = EtcdClient(urls[:1], tls)
    assert right.get(b"tls/never") is None
    right.close()


@needs_etcd
def test_a_killed_leader_is_replaced_and_catches_up_when_restarted(tls_cluster):
    members, urls, tls, _ = tls_cluster
    client = EtcdClient(urls, tls)
    leader = client.leader_endpoint()
    assert leader in urls
    killed = members[urls.index(leader)]
    killed.kill()
    assert not killed.alive
    successor = _new_leader(client, leader)
    survivors = EtcdClient([leader, *[url for url in urls if url != leader]], tls)  # the dead one first
    done, revision = survivors.txn([], [Put(b"tls/after", b"the leader died")])
    assert done and survivors.get(b"tls/after").value == b"the leader died"
    assert successor != leader
    killed.start()  # the same data folder: it rejoins with the state it had
    killed.wait_ready(READY)
    rejoined = EtcdClient([leader], tls)
    assert _caught_up(rejoined, b"tls/after").mod_revision == revision
    for each in (client, survivors, rejoined):
        each.close()


def _new_leader(client: EtcdClient, old: str) -> str:
    """The leader the members elect after ``old`` died (polled for: an election takes about a second)."""
    ends = time.monotonic() + READY
    while time.monotonic() < ends:
        try:
            leader = client.leader_endpoint()
        except EtcdUnavailable:
            leader = None
        if leader not in (None, old):
            return leader
        time.sleep(0.1)
    raise AssertionError(f"no new leader in {READY} s after {old} was killed")


def _caught_up(client: EtcdClient, key: bytes):
    """``key`` as a restarted member serves it once it has caught up (polled for)."""
    ends = time.monotonic() + READY
    while time.monotonic() < ends:
        try:
            found = client.get(key)
        except EtcdUnavailable:
            found = None
        if found is not None:
            return found
        time.sleep(0.1)
    raise AssertionError(f"the restarted member never served {key!r}")


# -- members and their certificates ---------------------------------------------------------------

def test_cluster_certificates_are_made_once_with_private_keys(tmp_path):
    folder = tmp_path / "certs"
    tls = make_cluster_certs(folder, ["10.0.0.5", "etcd-1.example"])
    assert (tls.ca, tls.cert, tls.key) == (folder / "ca.crt", folder / "client.crt", folder / "client.key")
    files = {name: (folder / name).read_bytes() for name in ("ca.crt", "member.crt", "member.key", "client.crt",
                                                             "client.key")}
    for key in ("member.key", "client.key", "ca.key"):
        assert stat.S_IMODE((folder / key).stat().st_mode) == 0o600
    names = x509.load_pem_x509_certificate(files["member.crt"]).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.5", "127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["etcd-1.example", "localhost"]
    make_cluster_certs(folder, ["10.0.0.5"])
    assert {name: (folder / name).read_bytes() for name in files} == files
    make_cluster_certs(folder, ["10.0.0.6"])  # a new host: a new member certificate, the same CA
    assert (folder / "ca.crt").read_bytes() == files["ca.crt"]
    assert (folder / "member.crt").read_bytes() != files["member.crt"]
    (folder / "ca.key").unlink()
    with pytest.raises(ConfigError, match="ca.key is not"):
        make_cluster_certs(folder, ["10.0.0.7"])


@needs_etcd
def test_a_member_that_cannot_start_says_why(tmp_path):
    spec = member_specs(tmp_path, 1)[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", spec.client_port))
        taken.listen()
        member = EtcdMember(spec, [spec], None)
        member.start()
        try:
            with pytest.raises(EtcdMemberFailed, match="address already in use") as failed:
                member.wait_ready(READY)
        finally:
            member.stop()
    assert "\n" not in str(failed.value) and "m0" in str(failed.value)


@needs_etcd
def test_a_member_dies_with_the_process_that_started_it(tmp_path):
    spec = member_specs(tmp_path, 1)[0]
    owner_code = ("import sys; from pathlib import Path\n"
                  "from meshlearn.network.bootstrap.etcdcluster import EtcdMember, MemberSpec\n"
                  f"spec = MemberSpec('m0', '127.0.0.1', {spec.client_port}, {spec.peer_port}, Path({str(tmp_path)!r}))\n"
                  "member = EtcdMember(spec, [spec], None)\n"
                  "member.start(); member.wait_ready(30); print(member.pid, flush=True); sys.stdin.read()\n")
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    etcd_pid = None
    try:
        etcd_pid = int(owner.stdout.readline())
        assert _running(etcd_pid)
        owner.kill()
        owner.wait()
        ends = time.monotonic() + READY
        while _running(etcd_pid) and time.monotonic() < ends:
            time.sleep(0.05)
        assert not _running(etcd_pid), "etcd outlived the process that started it"
    finally:
        owner.kill()
        owner.wait()
        if etcd_pid is not None and _running(etcd_pid):
            os.kill(etcd_pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead and not yet reaped by init, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_bad_endpoints_and_tls_files_are_refused_at_once(tmp_path):
    for endpoints in ([], ["ftp://127.0.0.1:2379"], ["http://127.0.0.1:2379/v3"], ["https://127.0.0.1:2379"],
                      ["127.0.0.1:2379"]):
        with pytest.raises(ConfigError):
            EtcdClient(endpoints)
    with pytest.raises(ConfigError, match="cannot load the etcd TLS files"):
        EtcdClient(["https://127.0.0.1:2379"], EtcdTls(tmp_path / "ca.crt"))
    assert EtcdClient(["http://[::1]", "https://h:1"], EtcdTls(make_cluster_certs(tmp_path, []).ca)).endpoints == \
        ["http://[::1]:2379", "https://h:1"]


def test_prefix_end():
    assert prefix_end(b"a/") == b"a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == prefix_end(b"") == b"\0"


# -- endpoints that fail ---------------------------------------------------------------------------

class _Request(BaseHTTPRequestHandler):
    """Hands each request to its fake endpoint's ``respond``."""

    protocol_version = "HTTP/1.1"

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.fake.seen.append((self.path, body))
        self.server.fake.respond(self)

    def answer(self, status: int, body: bytes, length: int | None = None, close: bool = False) -> None:
        """Send ``body`` (saying it is ``length`` bytes; without: ending where the connection does)."""
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if length is not None:
            self.send_header("Content-Length", str(length))
        self.close_connection = close or length is None
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _FakeEndpoint:
    """A local HTTP server that answers each POST with ``respond(request)`` and keeps what it saw;
    ``held`` is set when the test ends, releasing a ``respond`` that waits on it."""

    def __init__(self, respond):
        self.respond, self.seen, self.held = respond, [], threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Request)
        self.server.daemon_threads = True
        self.server.fake = self
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc_info):
        self.held.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(HELD)


def _json(status: int, answer):
    """A respond that sends ``answer`` as JSON with HTTP ``status``."""
    body = json.dumps(answer).encode()
    return lambda request: request.answer(status, body, len(body))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _kvs(**fields) -> dict:
    return {"header": {"revision": "5"}, "kvs": [{"key": _b64(b"k"), "mod_revision": "3", **fields}]}


ANY = ("get", "range", "txn", "status", "leader_endpoint")
KV = ("get", "range")
MALFORMED = {  # what a broken endpoint answers, and the calls it breaks
    "not JSON": (lambda request: request.answer(200, b"<html>", 6), ANY),
    "a JSON list": (_json(200, [1, 2]), ANY),
    "nested too deep": (lambda request: request.answer(200, b"[" * 100000, 100000), ANY),
    "HTTP 500, not etcd's error": (lambda request: request.answer(500, b"oops", 4), ANY),
    "an error of no code": (_json(503, {"error": "broken"}), ANY),
    "etcd timing out": (_json(503, {"error": "etcdserver: request timed out", "code": 14}), ANY),
    "a length beyond the limit": (lambda request: request.answer(200, b"{}", 100 << 20), ANY),
    "a body beyond the limit": (lambda request: request.answer(200, b"[" + b"0," * (1 << 20) + b"0]"), ANY),
    "a connection closed mid-answer": (lambda request: request.answer(200, b'{"kvs": [', 100, close=True), ANY),
    "kvs not a list": (_json(200, {"kvs": "all of them"}), KV),
    "a key not base64": (_json(200, _kvs(key="not base64!")), KV),
    "a value not text": (_json(200, _kvs(value=7)), KV),
    "a revision not a number": (_json(200, _kvs(mod_revision="three")), KV),
    "a negative revision": (_json(200, _kvs(mod_revision="-3")), KV),
    "a revision that is a bool": (_json(200, _kvs(mod_revision=True)), KV),
    "a revision beyond 64 bits": (_json(200, _kvs(mod_revision=str(1 << 64))), KV),
    "a key without its name": (_json(200, {"kvs": [{"value": _b64(b"v")}]}), KV),
    "a header not an object": (_json(200, {"header": "5"}), ("get", "range", "txn", "status")),
    "succeeded not a bool": (_json(200, {"header": {"revision": "5"}, "succeeded": "yes"}), ("txn",)),
    "a leader not a number": (_json(200, {"leader": "me"}), ("status",)),
    "members not a list": (_json(200, {"members": {"ID": "1"}}), ("leader_endpoint",)),
    "a client URL not text": (_json(200, {"members": [{"ID": "1", "clientURLs": [7]}]}), ("leader_endpoint",)),
}


@pytest.mark.parametrize("answer, calls", MALFORMED.values(), ids=MALFORMED.keys())
def test_an_answer_etcd_never_sends_is_that_endpoint_failing(answer, calls, monkeypatch, no_pause):
    monkeypatch.setattr(etcd, "MAX_ANSWER_BYTES", 1 << 20)
    with _FakeEndpoint(answer) as fake:
        client = EtcdClient([fake.url], timeout=1.0, deadline=2.0)
        made = {"get": lambda: client.get(b"k"), "range": lambda: client.range(b"k"),
                "txn": lambda: client.txn([], [Put(b"k", b"v")]), "status": lambda: client.status(fake.url),
                "leader_endpoint": client.leader_endpoint}
        for call in calls:
            with pytest.raises(EtcdUnavailable) as failed:
                made[call]()
            assert fake.url in str(failed.value) and "\n" not in str(failed.value), call
        client.close()


def test_dead_endpoints_give_up_within_the_deadline():
    listening = socket.socket()  # accepts connections (the kernel does) and never answers
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    silent = f"http://127.0.0.1:{listening.getsockname()[1]}"
    refused = [f"http://127.0.0.1:{free_port()}" for _ in range(2)]
    try:
        client = EtcdClient([*refused, silent], timeout=0.3, deadline=2.0)
        with pytest.raises(EtcdUnavailable, match="no quorum reachable") as failed:
            client.get(b"k")
        assert not isinstance(failed.value, AmbiguousCommit)
        assert "cannot connect" in str(failed.value) and "did not answer in time" in str(failed.value)
        with pytest.raises(EtcdUnavailable, match="cannot connect"):
            EtcdClient(refused, timeout=0.3, deadline=2.0).txn([], [Put(b"k", b"v")])
    finally:
        listening.close()


def _hold(fake_of: list):
    """A respond that keeps the request unanswered until the test ends."""
    return lambda request: fake_of[0].held.wait(HELD)


def test_a_write_whose_answer_never_came_is_ambiguous_and_not_sent_again():
    fake_of = []
    with _FakeEndpoint(_hold(fake_of)) as hanging, _FakeEndpoint(_json(200, {"succeeded": True})) as second:
        fake_of.append(hanging)
        client = EtcdClient([hanging.url, second.url], timeout=0.5, deadline=5.0)
        with pytest.raises(AmbiguousCommit, match="may or may not have applied") as unsure:
            client.txn([], [Put(b"k", b"v")])
        assert hanging.url in str(unsure.value)
        assert [path for path, _ in hanging.seen] == ["/v3/kv/txn"]
        assert second.seen == []


def test_a_read_whose_answer_never_came_is_asked_again_elsewhere():
    fake_of = []
    with _FakeEndpoint(_hold(fake_of)) as hanging, _FakeEndpoint(_json(200, _kvs(value=_b64(b"v")))) as second:
        fake_of.append(hanging)
        client = EtcdClient([hanging.url, second.url], timeout=0.5, deadline=5.0)
        assert client.get(b"k").value == b"v"
        assert client.get(b"k").value == b"v"  # the one that answered last is asked first
        assert len(hanging.seen) == 1 and len(second.seen) == 2


@pytest.mark.parametrize("refusal", ["etcdserver: no leader", "etcdserver: too many requests"])
def test_a_write_refused_before_it_was_proposed_goes_to_the_next_endpoint(refusal):
    with _FakeEndpoint(_json(503, {"error": refusal, "code": 14})) as first, \
            _FakeEndpoint(_json(200, {"header": {"revision": "9"}, "succeeded": True})) as second:
        client = EtcdClient([f"http://127.0.0.1:{free_port()}", first.url, second.url], timeout=1.0)
        assert client.txn([], [Put(b"k", b"v")]) == (True, 9)
        assert len(first.seen) == len(second.seen) == 1
        body = json.loads(second.seen[0][1])
        assert body["success"] == [{"request_put": {"key": _b64(b"k"), "value": _b64(b"v")}}]


def test_a_write_etcd_may_have_applied_before_it_erred_is_ambiguous():
    with _FakeEndpoint(_json(503, {"error": "etcdserver: request timed out", "code": 14})) as first, \
            _FakeEndpoint(_json(200, {"succeeded": True})) as second:
        with pytest.raises(AmbiguousCommit, match="request timed out"):
            EtcdClient([first.url, second.url]).txn([], [Delete(b"k", prefix=True)])
        assert second.seen == []


def test_a_connection_the_member_closed_while_idle_is_not_mistaken_for_a_lost_write():
    closed = threading.Event()

    def answer_then_close(request):  # says nothing of closing (keep-alive), then closes
        _json(200, {"header": {"revision": "9"}, "succeeded": True})(request)
        request.wfile.flush()
        request.connection.shutdown(socket.SHUT_RDWR)
        closed.set()

    with _FakeEndpoint(answer_then_close) as fake:
        client = EtcdClient([fake.url], timeout=1.0)
        assert client.txn([], [Put(b"k", b"1")]) == (True, 9)
        assert closed.wait(HELD)
        assert client.txn([], [Put(b"k", b"2")]) == (True, 9)  # on a new connection, not AmbiguousCommit
        assert len(fake.seen) == 2
        client.close()
