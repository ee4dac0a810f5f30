"""The registry in an etcd cluster, shared by several bootstraps: every write linearizable, and the
registry available while a majority of the cluster's members lives.

One key per record under ``/meshlearn/registry/``: ``p/ID`` a provider, ``t/ID`` a task, ``r/KEY`` a
revoked key, ``h/AT-N`` an event of the history (in the order the cluster took them), ``l/ID`` when a
provider last left (JSON values). A transaction reads at one revision of
the cluster (a snapshot) and commits only if nothing it read changed since: every key it read keeps
its revision, and no key was added to or changed in a range it listed (etcd compares on ranges).
Otherwise it runs again from fresh reads (optimistic concurrency, as etcd's own STM does).

A commit whose answer was lost (a leader killed while it held it) may or may not have happened.
Each store fences its own commits with one key of its own (``x/STORE``): every commit checks that
key's revision and writes it. To learn what became of a lost commit, the store reads the key: its
commit's mark there means done; otherwise one write to the key makes the lost commit fail forever,
wherever it still waits, and the transaction runs again.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict

from meshlearn.errors import ServiceUnavailable, UserInputError
from meshlearn.network.bootstrap.etcd import (
    AmbiguousCommit,
    Delete,
    EtcdClient,
    EtcdTls,
    EtcdUnavailable,
    Put,
    mod_revision_is,
    none_modified_since,
)
from meshlearn.network.bootstrap.registrystore import HISTORY_KEPT, EtcdLocation, ProviderInfo, T, TaskRecord

log = logging.getLogger(__name__)
ROOT = b"/meshlearn/registry/"
PROVIDERS, TASKS, REVOKED, HISTORY, FENCES, LEFT = (ROOT + part for part in (b"p/", b"t/", b"r/", b"h/", b"x/",
                                                                                b"l/"))
MAX_TRIES = 50  # runs of one transaction that lost to concurrent writes, before it gives up
PRUNE_EVERY = 500  # events noted by this store between two prunings of the history
COOL_DOWN = 1.0  # seconds after the cluster failed to answer during which requests fail at once


class RegistryUnavailable(ServiceUnavailable):
    """The registry's cluster cannot be reached, or has no majority: nothing can be granted now
    (a peer asks another bootstrap)."""


class EtcdStore:
    """The registry's records as keys of an etcd cluster (``EtcdLocation``), shared by every
    bootstrap that opens the same cluster."""

    def __init__(self, where: EtcdLocation):
        self.where = where
        self._client: EtcdClient | None = None
        self._lock = threading.Lock()  # this store's commits one at a time: its fence is its own
        self._fence = FENCES + secrets.token_hex(8).encode()
        self._fence_revision = 0
        self._noted = 0
        self._down_until = 0.0  # monotonic: until then the cluster is taken as unavailable
        self._down_why = ""

    def open(self) -> None:
        """Connect to the cluster and check that a majority answers (one line where it does not)."""
        tls = None
        if self.where.tls is not None:
            tls = EtcdTls(self.where.tls / "ca.crt", self.where.tls / "client.crt", self.where.tls / "client.key")
            for path in (tls.ca, tls.cert, tls.key):
                if not path.is_file():
                    raise UserInputError(f"--registry-tls {self.where.tls}: {path.name} is missing: give the folder "
                                         "`meshlearn cluster` wrote the cluster's certificates to")
        self._client = EtcdClient(list(self.where.endpoints), tls)
        try:
            self._client.get(self._fence)  # a linearizable read: a majority answered
        except EtcdUnavailable as exc:
            self.close()
            raise RegistryUnavailable(str(exc)) from None

    @property
    def is_open(self) -> bool:
        return self._client is not None

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def describe(self) -> str:
        return "etcd://" + ",".join(e.split("://", 1)[-1] for e in self.where.endpoints)

    def read(self, fn: Callable[[_Snapshot], T]) -> T:
        assert self._client is not None, "Registry.open() first"
        self._check_up()
        try:
            return fn(_Snapshot(self._client))
        except EtcdUnavailable as exc:
            raise self._went_down(exc) from None

    def write(self, fn: Callable[[_Snapshot], T]) -> T:
        assert self._client is not None, "Registry.open() first"
        self._check_up()
        with self._lock:
            try:
                result = self._commit(fn)
            except EtcdUnavailable as exc:
                raise self._went_down(exc) from None
        self._prune_history()
        return result

    def _check_up(self) -> None:
        """Fail at once for COOL_DOWN after the cluster last failed to answer: a bootstrap cut off from
        the majority tells its callers to ask another, without holding each of them (or the thread that
        admits connections) for a whole timeout."""
        if time.monotonic() < self._down_until:
            raise RegistryUnavailable(self._down_why)

    def _went_down(self, exc: EtcdUnavailable) -> RegistryUnavailable:
        self._down_until, self._down_why = time.monotonic() + COOL_DOWN, str(exc)
        return RegistryUnavailable(str(exc))

    def _commit(self, fn: Callable[[_Snapshot], T]) -> T:
        """Run ``fn`` and commit what it wrote, again from fresh reads while a concurrent write wins."""
        for attempt in range(MAX_TRIES):
            tx = _Snapshot(self._client)
            result = fn(tx)
            if not tx.writes:
                return result
            mark = secrets.token_hex(8).encode()
            compares = [*tx.compares(), mod_revision_is(self._fence, self._fence_revision)]
            ops = [*tx.writes.values(), Put(self._fence, mark)]
            try:
                done, revision = self._client.txn(compares, ops)
            except AmbiguousCommit:
                done, revision = self._settle(mark)
            if done:
                self._fence_revision = revision
                self._noted += tx.noted
                return result
            self._fence_revision = self._revision_of(self._fence)  # a lost commit's fence write moved it
            time.sleep(min(0.05, 0.002 * (attempt + 1)) * (1 + secrets.randbelow(100) / 100))
        raise RegistryUnavailable(f"the registry at {self.describe()} kept changing under a transaction "
                                  f"({MAX_TRIES} tries): too many bootstraps write at once; try again")

    def _settle(self, mark: bytes) -> tuple[bool, int]:
        """What became of a commit whose answer was lost: (True, its revision) where its mark is in
        this store's fence; else the fence moved on (so it can never apply), and (False, 0)."""
        while True:
            known = self._client.get(self._fence)
            if known is not None and known.value == mark:
                return True, known.mod_revision
            seen = known.mod_revision if known is not None else 0
            try:
                moved, _ = self._client.txn([mod_revision_is(self._fence, seen)],
                                            [Put(self._fence, secrets.token_hex(8).encode())])
            except AmbiguousCommit:
                continue  # the fence's own write may have happened: look again
            if moved:
                return False, 0

    def _revision_of(self, key: bytes) -> int:
        known = self._client.get(key)
        return 0 if known is None else known.mod_revision

    def _prune_history(self) -> None:
        """Drop the oldest events beyond HISTORY_KEPT, every PRUNE_EVERY events this store noted (outside
        any transaction: events are only ever added, by keys no other write reads)."""
        if self._noted < PRUNE_EVERY:
            return
        self._noted = 0
        try:
            events, _ = self._client.range(HISTORY)
            events.sort(key=lambda kv: kv.create_revision)
            old = events[:-HISTORY_KEPT] if len(events) > HISTORY_KEPT else []
            for start in range(0, len(old), 100):
                self._client.txn([], [Delete(kv.key) for kv in old[start:start + 100]])
        except EtcdUnavailable as exc:
            log.warning("the registry's history was not pruned (%s); next time", exc)


class _Snapshot:
    """One transaction: reads at one revision of the cluster (the first read's), writes buffered
    and seen by its own later reads, and what must be unchanged for its writes to commit."""

    def __init__(self, client: EtcdClient):
        self.client = client
        self.revision = 0  # 0 until the first read pins it
        self.read_keys: dict[bytes, int] = {}  # key -> its mod revision as read (0: absent)
        self.read_ranges: set[bytes] = set()
        self.writes: dict[bytes, Put | Delete] = {}
        self.noted = 0

    def compares(self) -> list:
        return ([mod_revision_is(key, revision) for key, revision in self.read_keys.items()]
                + [none_modified_since(prefix, self.revision) for prefix in self.read_ranges])

    def _get(self, key: bytes) -> dict | None:
        if key in self.writes:
            op = self.writes[key]
            return json.loads(op.value) if isinstance(op, Put) else None
        found, revision = self.client.get_at(key, self.revision)  # the first read pins the snapshot's revision
        self.revision = self.revision or revision
        self.read_keys[key] = found.mod_revision if found else 0
        return _loaded(found.value) if found else None

    def _list(self, prefix: bytes) -> list[tuple[bytes, dict]]:
        kvs, revision = self.client.range(prefix, self.revision)
        self.revision = self.revision or revision
        self.read_ranges.add(prefix)
        records = {kv.key: _loaded(kv.value) for kv in kvs}
        for key, op in self.writes.items():
            if key.startswith(prefix):
                if isinstance(op, Put):
                    records[key] = json.loads(op.value)
                else:
                    records.pop(key, None)
        return sorted((key, value) for key, value in records.items() if value is not None)

    def _put(self, key: bytes, value: dict) -> None:
        self.writes[key] = Put(key, json.dumps(value, separators=(",", ":")).encode())

    def provider(self, provider_id: str) -> ProviderInfo | None:
        found = self._get(PROVIDERS + provider_id.encode())
        return None if found is None else _record(ProviderInfo, found)

    def providers(self) -> list[ProviderInfo]:
        return [_record(ProviderInfo, value) for _, value in self._list(PROVIDERS)]

    def put_provider(self, info: ProviderInfo) -> None:
        self._put(PROVIDERS + info.id.encode(), asdict(info))

    def delete_provider(self, provider_id: str) -> None:
        self.writes[PROVIDERS + provider_id.encode()] = Delete(PROVIDERS + provider_id.encode())

    def task(self, task_id: str) -> TaskRecord | None:
        found = self._get(TASKS + task_id.encode())
        return None if found is None else _record(TaskRecord, found)

    def tasks(self, limit: int) -> list[TaskRecord]:
        records = [_record(TaskRecord, value) for _, value in self._list(TASKS)]
        return sorted(records, key=lambda t: -t.created)[:limit]

    def put_task(self, record: TaskRecord) -> None:
        self._put(TASKS + record.id.encode(), asdict(record))

    def revoked(self) -> list[str]:
        return [key.decode()[len(REVOKED):] for key, _ in sorted(self._list(REVOKED), key=lambda kv: kv[1]["at"])]

    def is_revoked(self, key: str) -> bool:
        return self._get(REVOKED + key.encode()) is not None

    def revoke(self, key: str, at: float) -> None:
        self._put(REVOKED + key.encode(), {"at": at})

    def note(self, at: float, kind: str, subject: str, detail: str) -> None:
        self.noted += 1  # a key of its own, unique: no other transaction reads it before it is there
        key = HISTORY + f"{at:017.6f}-{secrets.token_hex(4)}".encode()
        self._put(key, {"at": at, "kind": kind, "subject": subject, "detail": detail})
        if kind == "left":  # and when it last left, by provider: ``left_since`` reads a key each, not the history
            before = self._get(LEFT + subject.encode())
            self._put(LEFT + subject.encode(), {"at": max(at, before.get("at", 0) if before else 0)})

    def _events(self) -> list[dict]:
        kvs, revision = self.client.range(HISTORY, self.revision)  # not a compared range: added to, never changed
        self.revision = self.revision or revision
        kvs.sort(key=lambda kv: kv.create_revision)  # the order the cluster took them in
        return [event for event in (_loaded(kv.value) for kv in kvs) if event is not None]

    def history(self, limit: int) -> list[dict]:
        return self._events()[::-1][:limit]

    def left_since(self, provider_ids: list[str], since: float) -> list[str]:
        last_left = {provider_id: self._get(LEFT + provider_id.encode()) for provider_id in set(provider_ids)}
        return sorted(p for p, left in last_left.items() if left is not None and left.get("at", 0) >= since)


def _record(kind: type[T], value: dict) -> T:
    """A ProviderInfo or TaskRecord from its JSON, fields another version added left out."""
    return kind(**{name: value[name] for name in kind.__dataclass_fields__ if name in value})


def _loaded(value: bytes) -> dict | None:
    """A record's JSON (None, and a warning, for a value no bootstrap wrote)."""
    try:
        record = json.loads(value)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        log.warning("the registry holds a value that is not a record; ignored")
        return None
    return record
