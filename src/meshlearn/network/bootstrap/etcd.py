"""A small etcd v3 client over etcd's JSON gateway (standard library only), for a bootstrap registry
that 3 or 5 bootstraps share in one etcd cluster.

etcd 3.4 serves ``POST /v3/kv/range`` and the like with JSON bodies: keys and values in base64,
int64 fields as strings, absent fields meaning 0/false/empty. Every answer is checked (a JSON object
of the expected types, bounded in size); an answer that is not is that endpoint failing.

Failover and its one trap: a read, or a request that never left (a refused connection), is tried on
the next endpoint; a write whose request was sent but whose answer never came may have been applied,
so it is never sent again: it raises :class:`AmbiguousCommit`, and the caller reads back to learn
whether it was.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from meshlearn.errors import ConfigError, NetworkError, RemoteError

MAX_ANSWER_BYTES = 64 << 20  # an answer larger than this is refused (a broken or hostile endpoint)
RANGE_PAGE = 500  # keys per range request; every page is read at the first page's revision
PASSES = 2  # each endpoint is tried at most this many times per call
PASS_PAUSE = 0.25  # seconds between two passes over the endpoints (an election takes about a second)
READ_CHUNK = 1 << 20  # bytes read from an answer at a time
DEFAULT_PORT = 2379  # etcd's client port, when an endpoint names none
MAX_REASON_CHARS = 200  # an error text from etcd is cut to this length in our messages
_INT = re.compile(r"-?[0-9]{1,20}")
_UINT64_END = 1 << 64

# gRPC status codes etcd's gateway reports (its "code" field)
_REFUSED_CODES = {3, 5, 6, 7, 9, 11, 12, 16}  # the request itself is wrong: never applied, retrying is useless
_BUSY_CODES = {8}  # "too many requests": refused before it was proposed; another member may take it
# messages of errors etcd answers before a write was proposed to raft: safe to send elsewhere
_NOT_PROPOSED = ("etcdserver: no leader", "etcdserver: too many requests", "etcdserver: not capable",
                 "raft proposal dropped")


class EtcdUnavailable(NetworkError):
    """No endpoint of the registry's etcd cluster served a request before the client's deadline."""


class AmbiguousCommit(EtcdUnavailable):
    """A write was sent but its answer never came: it may or may not have been applied."""


class EtcdRefused(RemoteError):
    """etcd understood a request and refused it (a compacted revision, too many operations in a
    transaction, a request too large): sending it again would not help."""


@dataclass(frozen=True)
class EtcdTls:
    """What a client needs for an etcd cluster started with TLS: the cluster's CA certificate and,
    for a cluster that checks clients (``--client-cert-auth``), a client certificate and key it signed."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None


@dataclass(frozen=True)
class KeyValue:
    """One key as etcd keeps it: its value and the revisions that made and last changed it."""

    key: bytes
    value: bytes
    mod_revision: int
    create_revision: int
    version: int


@dataclass(frozen=True)
class Compare:
    """A condition of a transaction (build it with :func:`mod_revision_is` or
    :func:`none_modified_since`): the keys ``key`` (up to ``range_end``, if given) have a
    ``target`` revision that stands in ``result`` to ``revision``."""

    key: bytes
    range_end: bytes
    target: str
    result: str
    revision: int


@dataclass(frozen=True)
class Put:
    """A transaction's operation: set ``key`` to ``value``."""

    key: bytes
    value: bytes


@dataclass(frozen=True)
class Delete:
    """A transaction's operation: delete ``key`` (with ``prefix``: every key that starts with it)."""

    key: bytes
    prefix: bool = False


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix`` (etcd's
    convention: the prefix with its last byte below 0xff incremented; ``b"\\0"`` for all keys)."""
    for index in range(len(prefix) - 1, -1, -1):
        if prefix[index] < 0xFF:
            return prefix[:index] + bytes([prefix[index] + 1])
    return b"\0"


def mod_revision_is(key: bytes, revision: int) -> Compare:
    """``key`` was last changed at ``revision`` (0: the key does not exist)."""
    return Compare(key, b"", "MOD", "EQUAL", revision)


def none_modified_since(prefix: bytes, revision: int) -> Compare:
    """No key under ``prefix`` was changed after ``revision`` (keys deleted since are not seen)."""
    return Compare(_range_start(prefix), prefix_end(prefix), "MOD", "LESS", revision + 1)


class _Failed(Exception):
    """One endpoint failed before the request could have been applied: safe to try the next."""


class _Unsure(Exception):
    """One endpoint failed after the request was sent: a write may have been applied."""


class _Malformed(ValueError):
    """An answer that is not what etcd sends."""


class EtcdClient:
    """A client of one etcd cluster through its JSON gateway, used by a bootstrap's registry.

    ``endpoints``: the members' client URLs (``http://host:2379`` or ``https://...`` with ``tls``);
    ``timeout``: seconds one request to one endpoint may take; ``deadline``: seconds a call may take
    over all its endpoints. Safe to share between threads (one request at a time). Making it does no
    network I/O; it reads the TLS files and refuses bad endpoints or files with a ConfigError."""

    def __init__(self, endpoints: Sequence[str], tls: EtcdTls | None = None, timeout: float = 2.0,
                 deadline: float = 5.0):
        if not endpoints:
            raise ConfigError("no etcd endpoint given: give the client URLs of the registry's etcd members")
        self.endpoints = [_normalized_endpoint(endpoint, tls is not None) for endpoint in endpoints]
        self.timeout, self.deadline = timeout, deadline
        self._context = _ssl_context(tls) if tls is not None else None
        self._connections: dict[str, http.client.HTTPConnection] = {}
        self._preferred = 0  # index of the endpoint that answered last
        self._lock = threading.Lock()

    # -- the key-value API ------------------------------------------------------------------------

    def get(self, key: bytes) -> KeyValue | None:
        """``key``'s current value (a linearizable read), or None if it does not exist."""
        return self.get_at(key)[0]

    def get_at(self, key: bytes, revision: int = 0) -> tuple[KeyValue | None, int]:
        """``key`` alone as it was at ``revision`` (0: now), or None where it did not exist, and the
        header revision of the answer (with ``revision`` 0: the revision it was read at)."""
        body = {"key": _b64(key)}
        if revision:
            body["revision"] = str(revision)
        kvs, _, header = self._call("/v3/kv/range", body, write=False, parse=_parse_range)
        return (kvs[0] if kvs else None), header

    def range(self, prefix: bytes, revision: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix``, sorted by key, read at ``revision`` (0: now), and the header
        revision of the answer (with ``revision`` 0: the revision the keys were read at). A large
        range is read in pages, all at that one revision."""
        start, end = _range_start(prefix), prefix_end(prefix)
        found: list[KeyValue] = []
        header = 0
        while True:
            body = {"key": _b64(start), "range_end": _b64(end), "limit": str(RANGE_PAGE)}
            if revision:
                body["revision"] = str(revision)
            kvs, more, page_revision = self._call("/v3/kv/range", body, write=False, parse=_parse_range)
            header = header or page_revision
            revision = revision or page_revision
            found += kvs
            if not more or not kvs:
                return found, header
            start = kvs[-1].key + b"\0"

    def txn(self, compares: Sequence[Compare], success: Sequence[Put | Delete],
            failure: Sequence[Put | Delete] = ()) -> tuple[bool, int]:
        """Apply ``success`` if every compare holds, else ``failure``, atomically; returns whether the
        compares held and the header revision. Raises AmbiguousCommit if the answer never came."""
        body = {"compare": [_compare_json(compare) for compare in compares],
                "success": [_operation_json(operation) for operation in success],
                "failure": [_operation_json(operation) for operation in failure]}
        return self._call("/v3/kv/txn", body, write=True, parse=_parse_txn)

    # -- the cluster ------------------------------------------------------------------------------

    def status(self, endpoint: str) -> dict:
        """What the member at ``endpoint`` says of itself: ``{"member_id", "leader", "raft_term"}``
        (leader 0: it knows of none). Asks that endpoint only; EtcdUnavailable if it does not answer."""
        endpoint = _normalized_endpoint(endpoint, self._context is not None)
        with self._lock:
            try:
                return self._attempt(endpoint, "/v3/maintenance/status", {}, time.monotonic() + self.timeout,
                                     _parse_status)
            except (_Failed, _Unsure) as exc:
                raise EtcdUnavailable(_unavailable_message([endpoint], {endpoint: str(exc)})) from None

    def leader_endpoint(self) -> str | None:
        """The client URL of the member that is the raft leader now (the one that says so of itself,
        at the highest term), or None if no member that answers is leader."""
        members = self._call("/v3/cluster/member/list", {}, write=False, parse=_parse_members)
        best: tuple[int, str] | None = None
        for urls in members.values():
            for url in urls[:1]:
                try:
                    status = self.status(url)
                except (EtcdUnavailable, EtcdRefused, ConfigError):
                    continue
                leads = status["leader"] != 0 and status["leader"] == status["member_id"]
                if leads and (best is None or status["raft_term"] > best[0]):
                    best = (status["raft_term"], _normalized_endpoint(url, self._context is not None))
        return None if best is None else best[1]

    def close(self) -> None:
        """Close every connection (a later call opens new ones)."""
        with self._lock:
            for connection in self._connections.values():
                connection.close()
            self._connections.clear()

    # -- failover ---------------------------------------------------------------------------------

    def _call(self, path: str, body: dict, write: bool, parse: Callable[[dict], Any]) -> Any:
        """Send one request to the endpoints in turn, from the one that answered last, until one
        answers; ``parse`` turns the answer into the result (raising _Malformed if it cannot)."""
        with self._lock:
            deadline = time.monotonic() + self.deadline
            reasons: dict[str, str] = {}
            for attempt in range(PASSES):
                if attempt:
                    _pause_until(deadline, PASS_PAUSE)
                for index in self._order():
                    if time.monotonic() >= deadline:
                        break
                    endpoint = self.endpoints[index]
                    try:
                        result = self._attempt(endpoint, path, body, deadline, parse)
                    except _Failed as exc:
                        reasons[endpoint] = str(exc)
                        continue
                    except _Unsure as exc:
                        if write:
                            raise AmbiguousCommit(_ambiguous_message(self.endpoints, endpoint, str(exc))) from None
                        reasons[endpoint] = str(exc)
                        continue
                    self._preferred = index
                    return result
            raise EtcdUnavailable(_unavailable_message(self.endpoints, reasons))

    def _order(self) -> list[int]:
        count = len(self.endpoints)
        return [(self._preferred + step) % count for step in range(count)]

    def _attempt(self, endpoint: str, path: str, body: dict, deadline: float, parse: Callable[[dict], Any]) -> Any:
        """One request to one endpoint within ``timeout`` (and ``deadline``): the parsed answer,
        or _Failed/_Unsure (the connection dropped), or EtcdRefused."""
        ends = min(deadline, time.monotonic() + self.timeout)
        connection = self._connection(endpoint, ends)
        try:
            status, raw = _exchange(connection, path, json.dumps(body).encode(), ends)
        except (_Failed, _Unsure):
            self._drop(endpoint)
            raise
        try:
            return parse(_answer(status, raw))
        except _Malformed as exc:
            self._drop(endpoint)
            raise _Unsure(f"answered what etcd does not send ({exc})") from None

    def _connection(self, endpoint: str, ends: float) -> http.client.HTTPConnection:
        """A connected keep-alive connection to ``endpoint``: the last one if the member did not
        close it meanwhile, else a new one (_Failed if it cannot be made: nothing was sent)."""
        connection = self._connections.get(endpoint)
        if connection is not None and (connection.sock is None or _closed_by_peer(connection.sock)):
            self._drop(endpoint)
            connection = None
        if connection is None:
            connection = self._new_connection(endpoint, max(ends - time.monotonic(), 0.001))
            self._connections[endpoint] = connection
        return connection

    def _new_connection(self, endpoint: str, timeout: float) -> http.client.HTTPConnection:
        parts = urlsplit(endpoint)
        host, port = parts.hostname or "", parts.port or DEFAULT_PORT
        if parts.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=timeout, context=self._context)
        else:
            connection = http.client.HTTPConnection(host, port, timeout=timeout)
        try:
            connection.connect()
        except ssl.SSLError as exc:
            connection.close()
            raise _Failed(_tls_reason(exc)) from None
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise _Failed(f"cannot connect ({_os_reason(exc)})") from None
        return connection

    def _drop(self, endpoint: str) -> None:
        connection = self._connections.pop(endpoint, None)
        if connection is not None:
            connection.close()


# -- one exchange ---------------------------------------------------------------------------------

def _exchange(connection: http.client.HTTPConnection, path: str, payload: bytes, ends: float) -> tuple[int, bytes]:
    """POST ``payload`` on ``connection`` and read the answer by ``ends``: (HTTP status, body).
    _Failed if the member refused our TLS certificate (so never read the request), else _Unsure."""
    try:
        if connection.sock is not None:
            connection.sock.settimeout(max(ends - time.monotonic(), 0.001))
        connection.request("POST", path, body=payload, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, _read_bounded(response, ends)
    except ssl.SSLError as exc:
        if "ALERT" in (exc.reason or ""):  # the member failed the handshake: the request was never read
            raise _Failed(_tls_reason(exc)) from None
        raise _Unsure(f"broke the connection ({exc.reason or exc})") from None
    except TimeoutError:
        raise _Unsure("did not answer in time") from None
    except (OSError, http.client.HTTPException) as exc:
        raise _Unsure(f"broke the connection ({_os_reason(exc)})") from None


def _read_bounded(response: http.client.HTTPResponse, ends: float) -> bytes:
    """The answer's body, refused if larger than MAX_ANSWER_BYTES or later than ``ends``."""
    length = response.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > MAX_ANSWER_BYTES:
        raise _Unsure(f"sent an answer of {int(length)} bytes, more than the {MAX_ANSWER_BYTES >> 20} MiB limit")
    chunks, size = [], 0
    while True:
        if time.monotonic() > ends:
            raise _Unsure("did not answer in time")
        chunk = response.read(READ_CHUNK)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_ANSWER_BYTES:
            raise _Unsure(f"sent an answer of more than the {MAX_ANSWER_BYTES >> 20} MiB limit")
        chunks.append(chunk)


def _answer(status: int, raw: bytes) -> dict:
    """The answer as a JSON object; an etcd error in it is raised as _Failed (not applied: another
    member may serve it), _Unsure (may have been applied), or EtcdRefused (the request is wrong)."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):
        raise _Malformed(f"HTTP {status}, not JSON") from None
    if not isinstance(answer, dict):
        raise _Malformed(f"HTTP {status}, a JSON {type(answer).__name__}, not an object")
    if status != 200 or "error" in answer:
        _raise_etcd_error(status, answer)
    return answer


def _raise_etcd_error(status: int, answer: dict) -> None:
    code, text = answer.get("code"), answer.get("error", answer.get("message"))
    if not isinstance(code, int) or isinstance(code, bool) or not isinstance(text, str):
        raise _Malformed(f"HTTP {status} without an etcd error")
    reason = _one_line(text)
    if any(marker in text for marker in _NOT_PROPOSED) or code in _BUSY_CODES:
        raise _Failed(f"answered {reason!r}")
    if code in _REFUSED_CODES:
        raise EtcdRefused(f"the registry's etcd cluster refused a request: {reason}")
    raise _Unsure(f"answered {reason!r}")


# -- requests and answers -------------------------------------------------------------------------

def _range_start(prefix: bytes) -> bytes:
    return prefix or b"\0"  # the empty prefix: every key, from the smallest


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _compare_json(compare: Compare) -> dict:
    found = {"key": _b64(compare.key), "target": compare.target, "result": compare.result,
             "mod_revision": str(compare.revision)}
    if compare.range_end:
        found["range_end"] = _b64(compare.range_end)
    return found


def _operation_json(operation: Put | Delete) -> dict:
    if isinstance(operation, Put):
        return {"request_put": {"key": _b64(operation.key), "value": _b64(operation.value)}}
    if isinstance(operation, Delete):
        request = {"key": _b64(_range_start(operation.key) if operation.prefix else operation.key)}
        if operation.prefix:
            request["range_end"] = _b64(prefix_end(operation.key))
        return {"request_delete_range": request}
    raise TypeError(f"a transaction's operation is a Put or a Delete, not {type(operation).__name__}")


def _parse_range(answer: dict) -> tuple[list[KeyValue], bool, int]:
    kvs = _field(answer, "kvs", list, [])
    return [_parse_kv(kv) for kv in kvs], _field(answer, "more", bool, False), _header_revision(answer)


def _parse_kv(kv: Any) -> KeyValue:
    if not isinstance(kv, dict):
        raise _Malformed("a key that is not an object")
    if "key" not in kv:
        raise _Malformed("a key without its name")
    return KeyValue(key=_bytes(kv, "key"), value=_bytes(kv, "value"), mod_revision=_int(kv, "mod_revision"),
                    create_revision=_int(kv, "create_revision"), version=_int(kv, "version"))


def _parse_txn(answer: dict) -> tuple[bool, int]:
    return _field(answer, "succeeded", bool, False), _header_revision(answer)


def _parse_status(answer: dict) -> dict:
    header = _field(answer, "header", dict, {})
    term = _int(answer, "raftTerm") or _int(header, "raft_term")
    return {"member_id": _int(header, "member_id"), "leader": _int(answer, "leader"), "raft_term": term}


def _parse_members(answer: dict) -> dict[int, list[str]]:
    """Each member's id and client URLs."""
    members = {}
    for member in _field(answer, "members", list, []):
        if not isinstance(member, dict):
            raise _Malformed("a member that is not an object")
        urls = _field(member, "clientURLs", list, [])
        if not all(isinstance(url, str) for url in urls):
            raise _Malformed("a client URL that is not a string")
        members[_int(member, "ID")] = urls
    return members


def _header_revision(answer: dict) -> int:
    return _int(_field(answer, "header", dict, {}), "revision")


def _field(obj: dict, name: str, kind: type, default: Any) -> Any:
    value = obj.get(name, default)
    if not isinstance(value, kind):
        raise _Malformed(f"{name} is a {type(value).__name__}, not a {kind.__name__}")
    return value


def _int(obj: dict, name: str) -> int:
    """An integer field: proto3 JSON writes 64-bit ones as strings, and leaves out zeros."""
    value = obj.get(name, 0)
    if isinstance(value, str) and _INT.fullmatch(value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < _UINT64_END:
        raise _Malformed(f"{name} is not a count")
    return value


def _bytes(obj: dict, name: str) -> bytes:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise _Malformed(f"{name} is not base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except ValueError:
        raise _Malformed(f"{name} is not base64") from None


# -- endpoints and messages -----------------------------------------------------------------------

def _normalized_endpoint(endpoint: str, secure: bool) -> str:
    """``endpoint`` as ``scheme://host:port`` (``secure``: the client has TLS files for https); a
    ConfigError says what is wrong with one that is not."""
    problem = None
    try:
        parts = urlsplit(endpoint.strip())
        host, port = parts.hostname, parts.port or DEFAULT_PORT
    except (ValueError, AttributeError):
        parts, host, port = None, None, DEFAULT_PORT
    if parts is None or parts.scheme not in ("http", "https") or not host or parts.path not in ("", "/"):
        problem = "give an etcd client URL like http://10.0.0.1:2379 or https://10.0.0.1:2379"
    elif parts.scheme == "https" and not secure:
        problem = "an https endpoint needs the cluster's CA and client certificate: give them"
    if problem:
        raise ConfigError(f"etcd endpoint {endpoint!r}: {problem}")
    shown = f"[{host}]" if ":" in host else host
    return f"{parts.scheme}://{shown}:{port}"


def _ssl_context(tls: EtcdTls) -> ssl.SSLContext:
    """One TLS context that trusts only the cluster's CA and shows the client certificate."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(tls.ca))
        # TLS 1.2: a member refuses our certificate within the handshake, so before any request is sent.
        # Under TLS 1.3 it refuses it only after our request left, and its alert can be lost to a reset:
        # a write would then look as if it might have been applied.
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        if tls.cert is not None:
            context.load_cert_chain(str(tls.cert), None if tls.key is None else str(tls.key))
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load the etcd TLS files (CA {tls.ca}, certificate {tls.cert}, key {tls.key}): "
                          f"{_os_reason(exc)}; give the cluster's ca.crt and a client.crt/client.key it signed") \
            from None
    return context


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether an idle keep-alive connection has something to read: the member closed it (or died)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


def _pause_until(deadline: float, pause: float) -> None:
    time.sleep(max(0.0, min(pause, deadline - time.monotonic())))


def _tls_reason(exc: ssl.SSLError) -> str:
    if isinstance(exc, ssl.SSLCertVerificationError):
        return (f"its TLS certificate is not one the cluster's CA signed for this address "
                f"({_one_line(exc.verify_message or str(exc))}): give the cluster's ca.crt")
    return (f"refused this client's TLS certificate ({_one_line(exc.reason or str(exc))}): "
            "give a client certificate and key the cluster's CA signed")


def _os_reason(exc: BaseException) -> str:
    return _one_line(getattr(exc, "strerror", None) or str(exc) or type(exc).__name__)


def _one_line(text: str) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS] + "..."


def _unavailable_message(endpoints: Sequence[str], reasons: dict[str, str]) -> str:
    tried = "; ".join(f"{endpoint} {reason}" for endpoint, reason in reasons.items()) or "no endpoint tried in time"
    return (f"the registry's etcd cluster ({', '.join(endpoints)}) has no quorum reachable from here: {tried}; "
            "check that most of its members run, that this host reaches their client ports, "
            "and that its certificates are the cluster's")


def _ambiguous_message(endpoints: Sequence[str], endpoint: str, reason: str) -> str:
    return (f"the registry's etcd cluster ({', '.join(endpoints)}) may or may not have applied a write: "
            f"{endpoint} {reason} after it was sent; read the registry back to learn whether it did")
