"""The bootstrap's registry of providers and tasks, kept in SQLite so a restart loses nothing.

Claims run in one ``BEGIN IMMEDIATE`` transaction: two requesters racing for the same provider
are serialized by SQLite, and the loser sees it busy. A claimed provider stays busy until it
reports that it ran the task, the task is released, or CLAIM_GRACE passes without the requester
showing up (its heartbeats saying "free" in between do not free it).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage, UserInputError
from meshlearn.network.task.resources import DEVICE_ORDER, wanted_device

CLAIM_GRACE = 300.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS providers (
    id TEXT PRIMARY KEY, address TEXT NOT NULL, ram_gb REAL NOT NULL, cores INTEGER NOT NULL,
    device TEXT NOT NULL, location TEXT NOT NULL, status TEXT NOT NULL, task TEXT,
    last_seen REAL NOT NULL, registered REAL NOT NULL, claimed_at REAL);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, requester TEXT NOT NULL, providers TEXT NOT NULL,
    created REAL NOT NULL, status TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS revoked (key TEXT PRIMARY KEY, at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS history (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, kind TEXT NOT NULL, subject TEXT NOT NULL,
    detail TEXT NOT NULL);
"""
HISTORY_KEPT = 5000  # the registry's history keeps this many events (older ones are dropped)
# columns added since the first registry files, with their defaults for rows written before
_ADDED = {"providers": [("key", "TEXT NOT NULL DEFAULT ''"), ("reachable", "INTEGER NOT NULL DEFAULT 1")],
          "tasks": [("requester_key", "TEXT NOT NULL DEFAULT ''")]}
_COLUMNS = "id,address,ram_gb,cores,device,location,status,task,last_seen,key,reachable"
_TASK_COLUMNS = "id,requester,providers,created,status,requester_key"


@dataclass
class ProviderInfo:
    """A provider as the registry knows it."""

    id: str
    address: str
    ram_gb: float
    cores: int
    device: str
    location: str
    status: str = "free"  # free | busy | leaving | lost (a task reported it lost: not claimed until it beats again)
    task: str | None = None
    last_seen: float = 0.0
    key: str = ""  # its public key, proven at registration; peers connect to address@key only
    reachable: bool = True  # False: its address is an allocation of the bootstrap's relay

    def public(self) -> dict:
        """What discovery hands out: the address carries the key the bootstrap vouches for."""
        return {**asdict(self), "address": self.pinned_address, "reachable": bool(self.reachable)}

    @property
    def pinned_address(self) -> str:
        return f"{self.address}@{self.key}" if self.key else self.address


class Registry:
    """Providers (with resources and heartbeats) and claimed tasks, persisted in one SQLite file."""

    def __init__(self, path: str | Path = ":memory:", clock: Clock = SYSTEM):
        self.path = str(path)
        self.clock = clock  # wall time: timestamps are stored and outlive a restart
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def open(self) -> "Registry":
        """Open (creating if needed) the database."""
        try:
            self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.executescript(_SCHEMA)
            for table, columns in _ADDED.items():
                have = {row[1] for row in self._db.execute(f"PRAGMA table_info({table})")}
                for name, kind in columns:
                    if name not in have:
                        self._db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
        except sqlite3.Error as exc:
            self.close()
            raise UserInputError(f"registry {self.path} cannot be used ({exc}): give the file a bootstrap "
                                 "wrote, or a new file name") from None
        return self

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _run(self, fn):
        assert self._db is not None, "Registry.open() first"
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    def register(self, info: ProviderInfo) -> None:
        """Add or refresh a provider (a re-registration keeps a task it still runs)."""
        now = self.clock.time()

        def add(db):
            known = db.execute("SELECT address FROM providers WHERE id=?", (info.id,)).fetchone()
            if known is None or known[0] != info.address:
                self._note(db, "registered", info.id, f"{info.address} ({info.device}, {info.cores} cores, "
                           f"{info.ram_gb:g} GB{', ' + info.location if info.location else ''}"
                           f"{'' if info.reachable else ', through the relay'})")
            db.execute(
                "INSERT INTO providers (id,address,ram_gb,cores,device,location,status,task,last_seen,registered,"
                "claimed_at,key,reachable) VALUES (?,?,?,?,?,?,?,?,?,?,NULL,?,?) ON CONFLICT(id) DO UPDATE SET "
                "address=excluded.address, ram_gb=excluded.ram_gb, cores=excluded.cores, device=excluded.device, "
                "location=excluded.location, status=excluded.status, task=excluded.task, "
                "last_seen=excluded.last_seen, key=excluded.key, reachable=excluded.reachable",
                (info.id, info.address, info.ram_gb, info.cores, info.device, info.location,
                 info.status, info.task, now, now, info.key, int(info.reachable)))
        self._run(add)

    def drop_unverified(self, keys_required: bool) -> list[str]:
        """Forget providers that must register again after a restart: those reached through the
        relay (its allocations died with the process) and, with ``keys_required``, those that
        never proved a key (a registry written before keys). Returns their ids."""
        def drop(db):
            where = "reachable=0" + (" OR key=''" if keys_required else "")
            gone = [r[0] for r in db.execute(f"SELECT id FROM providers WHERE {where}")]
            db.execute(f"DELETE FROM providers WHERE {where}")
            return gone
        return self._run(drop)

    def key_of(self, provider_id: str) -> str | None:
        """The key a provider registered with (None if it is not registered)."""
        row = self._run(lambda db: db.execute("SELECT key FROM providers WHERE id=?", (provider_id,)).fetchone())
        return None if row is None else row[0]

    def revoke(self, key: str) -> list[str]:
        """Shut ``key`` out: refused on every new connection from now on, its providers forgotten."""
        def shut(db):
            gone = [r[0] for r in db.execute("SELECT id FROM providers WHERE key=?", (key,))]
            db.execute("DELETE FROM providers WHERE key=?", (key,))
            db.execute("INSERT OR REPLACE INTO revoked VALUES (?,?)", (key, self.clock.time()))
            self._note(db, "revoked", key, "providers forgotten: " + (", ".join(gone) or "none"))
            return gone
        return self._run(shut)

    def is_revoked(self, key: str) -> bool:
        return self._run(lambda db: db.execute("SELECT 1 FROM revoked WHERE key=?", (key,)).fetchone()) is not None

    def revoked(self) -> list[str]:
        """Every revoked key (providers refuse them too, told with each heartbeat)."""
        return [r[0] for r in self._run(lambda db: db.execute("SELECT key FROM revoked ORDER BY at").fetchall())]

    def heartbeat(self, provider_id: str, status: str, task: str | None, last_task: str | None = None) -> bool:
        """Record that a provider is alive and what it is doing; False if it is not registered.

        A provider claimed for a task it has not started yet stays busy (see CLAIM_GRACE).
        """
        def beat(db):
            row = db.execute("SELECT status, task, claimed_at FROM providers WHERE id=?", (provider_id,)).fetchone()
            if row is None:
                return False
            new_status, new_task = status, task
            held, claimed, claimed_at = row[0] == "busy", row[1], row[2] or 0.0
            if held and status == "free" and claimed and claimed != last_task \
                    and self.clock.time() - claimed_at < CLAIM_GRACE:
                new_status, new_task = "busy", claimed  # claimed, the requester has not assigned it yet
            db.execute("UPDATE providers SET last_seen=?, status=?, task=? WHERE id=?",
                       (self.clock.time(), new_status, new_task, provider_id))
            return True
        return self._run(beat)

    def remove(self, provider_id: str) -> bool:
        """Forget a provider (it left); False if it was not registered."""
        def leave(db):
            gone = db.execute("DELETE FROM providers WHERE id=?", (provider_id,)).rowcount == 1
            if gone:
                self._note(db, "left", provider_id, "")
            return gone
        return self._run(leave)

    def left_since(self, provider_ids: list[str], since: float) -> list[str]:
        """Those of ``provider_ids`` that left the network (``meshlearn leave``, Ctrl-C) at or after
        ``since``, by the registry's history."""
        if not provider_ids:
            return []
        marks = ",".join("?" * len(provider_ids))
        rows = self._run(lambda db: db.execute(
            f"SELECT DISTINCT subject FROM history WHERE kind='left' AND at>=? AND subject IN ({marks})",
            (since, *provider_ids)).fetchall())
        return sorted(r[0] for r in rows)

    def expire(self, ttl: float) -> list[str]:
        """Remove providers without a heartbeat for ``ttl`` seconds; return their ids."""
        cutoff = self.clock.time() - ttl

        def sweep(db):
            gone = [r[0] for r in db.execute("SELECT id FROM providers WHERE last_seen < ?", (cutoff,))]
            db.execute("DELETE FROM providers WHERE last_seen < ?", (cutoff,))
            for provider_id in gone:
                self._note(db, "expired", provider_id, f"no heartbeat for {ttl:g} s")
            return gone
        return self._run(sweep)

    def providers(self) -> list[ProviderInfo]:
        """Every registered provider."""
        rows = self._run(lambda db: db.execute(f"SELECT {_COLUMNS} FROM providers").fetchall())
        return [ProviderInfo(*row) for row in rows]

    def discover(self, count: int, device: str = "any", location: str | None = None,
                 free_only: bool = True, min_ram_gb: float = 0.0, min_cores: int = 0,
                 fallback: bool = False) -> list[ProviderInfo]:
        """Up to ``count`` providers, as ``select`` chooses them (free ones only, unless ``free_only``
        is False)."""
        found = [p for p in self.providers()
                 if (not free_only or p.status == "free") and (not location or p.location == location)]
        return select(found, count, device, min_ram_gb, min_cores, fallback)

    def claim(self, task_id: str, requester: str, count: int, device: str = "any",
              location: str | None = None, requester_key: str = "", min_ram_gb: float = 0.0,
              min_cores: int = 0, fallback: bool = False, order: list[str] = ()) -> list[ProviderInfo]:
        """Atomically mark up to ``count`` free providers (as ``select`` chooses them) busy with
        ``task_id`` and record the task, bound to ``requester_key`` (the key that claimed it: the
        only one that may act on it). ``order``: the ids the requester prefers, first first (say,
        by round-trip time). A task claimed before, and not done, is claimed again by the key that
        claimed it (a task resumed after its processes died): its providers of then that are still
        marked busy with it are lost to it, and the claim records the new ones (BadMessage for
        another key's task, or one that is done)."""
        def take(db):
            earlier = db.execute("SELECT requester_key, status FROM tasks WHERE id=?", (task_id,)).fetchone()
            if earlier is not None:
                if earlier[0] != requester_key:
                    raise BadMessage(f"task {task_id} was claimed by another key")
                if earlier[1] == "done":
                    raise BadMessage(f"task {task_id} is done: it cannot be claimed again")
                db.execute("UPDATE providers SET status='lost', task=NULL WHERE task=? AND status='busy'", (task_id,))
            taken = self._take_free(db, task_id, (), location,
                                    lambda free: select(free, count, device, min_ram_gb, min_cores, fallback, order))
            if taken:
                members = json.dumps([{"id": p.id, "address": p.pinned_address} for p in taken])
                if earlier is None:
                    db.execute("INSERT INTO tasks (id,requester,providers,created,status,requester_key) "
                               "VALUES (?,?,?,?,?,?)", (task_id, requester, members, self.clock.time(), "running",
                                                        requester_key))
                else:
                    db.execute("UPDATE tasks SET providers=?, status='running' WHERE id=?", (members, task_id))
                self._note(db, "claimed" if earlier is None else "claimed again", task_id,
                           f"by {requester}: " + ", ".join(p.id for p in taken))
            return taken
        return self._run(take)

    def replace(self, task_id: str, drop: list[str], count: int, device: str = "any", location: str | None = None,
                exclude: list[str] = (), min_ram_gb: float = 0.0, min_cores: int = 0,
                fallback: bool = False) -> list[ProviderInfo]:
        """Take ``drop`` out of a running task (each set ``lost``: claimed again only once its next
        heartbeat says it lives) and, in the same transaction, claim up to ``count`` free providers
        in their place, never one of ``exclude`` (the task's earlier drops); the task's record then
        lists its providers as they are now (so a dropped one may no longer act on it)."""
        def swap(db):
            row = db.execute("SELECT providers, status FROM tasks WHERE id=?", (task_id,)).fetchone()
            if row is None or row[1] != "running":
                return []
            _set_lost(db, task_id, drop)
            skip = set(drop) | set(exclude)
            taken = self._take_free(db, task_id, skip, location,
                                    lambda free: select(free, count, device, min_ram_gb, min_cores, fallback))
            members = [m for m in json.loads(row[0]) if m["id"] not in skip]
            members += [{"id": p.id, "address": p.pinned_address} for p in taken]
            db.execute("UPDATE tasks SET providers=? WHERE id=?", (json.dumps(members), task_id))
            self._note(db, "replaced", task_id, f"{', '.join(drop)} by " + (", ".join(p.id for p in taken) or "none"))
            return taken
        return self._run(swap)

    def _take_free(self, db: sqlite3.Connection, task_id: str, skip: set[str] | tuple, location: str | None,
                   choose) -> list[ProviderInfo]:
        """Mark busy with ``task_id`` the free providers (at ``location``, none of ``skip``) that
        ``choose`` picks from them, inside the caller's transaction; returns them."""
        rows = db.execute(f"SELECT {_COLUMNS} FROM providers WHERE status='free'").fetchall()
        taken = choose([ProviderInfo(*r) for r in rows if r[0] not in skip and (not location or r[5] == location)])
        for p in taken:
            db.execute("UPDATE providers SET status='busy', task=?, claimed_at=? WHERE id=?",
                       (task_id, self.clock.time(), p.id))
            p.status, p.task = "busy", task_id
        return taken

    def release(self, task_id: str, status: str = "done", lost: list[str] = ()) -> None:
        """Free the providers of a task and record how it ended. Those the task lost are set
        ``lost``: never claimed until their next heartbeat says they live (a dead one expires),
        and still bound to their key, so nobody else can register their ids meanwhile."""
        def free(db):
            _set_lost(db, task_id, lost)
            db.execute("UPDATE providers SET status='free', task=NULL WHERE task=? AND status='busy'", (task_id,))
            if db.execute("UPDATE tasks SET status=? WHERE id=?", (status, task_id)).rowcount:
                self._note(db, "released", task_id, status + (f"; lost {', '.join(lost)}" if lost else ""))
        self._run(free)

    def task(self, task_id: str) -> dict | None:
        """A task's record: requester (name and key), providers (id and pinned address), status;
        None if unknown."""
        row = self._run(lambda db: db.execute(
            f"SELECT {_TASK_COLUMNS} FROM tasks WHERE id=?", (task_id,)).fetchone())
        return None if row is None else _task_record(row)

    def tasks(self, limit: int = 50) -> list[dict]:
        """The latest ``limit`` tasks' records, newest first."""
        rows = self._run(lambda db: db.execute(
            f"SELECT {_TASK_COLUMNS} FROM tasks ORDER BY created DESC LIMIT ?", (limit,)).fetchall())
        return [_task_record(r) for r in rows]

    def history(self, limit: int = 200) -> list[dict]:
        """The registry's latest ``limit`` events (registered, left, expired, revoked, claimed,
        released), newest first: {"at", "kind", "subject", "detail"}."""
        rows = self._run(lambda db: db.execute(
            "SELECT at,kind,subject,detail FROM history ORDER BY seq DESC LIMIT ?", (limit,)).fetchall())
        return [{"at": r[0], "kind": r[1], "subject": r[2], "detail": r[3]} for r in rows]

    def _note(self, db: sqlite3.Connection, kind: str, subject: str, detail: str) -> None:
        """Add an event to the history, inside the caller's transaction."""
        seq = db.execute("INSERT INTO history (at,kind,subject,detail) VALUES (?,?,?,?)",
                         (self.clock.time(), kind, subject, detail)).lastrowid
        if seq % 500 == 0:
            db.execute("DELETE FROM history WHERE seq <= ?", (seq - HISTORY_KEPT,))


def _task_record(row: tuple) -> dict:
    return {"id": row[0], "requester": row[1], "providers": json.loads(row[2]), "created": row[3], "status": row[4],
            "requester_key": row[5]}


def most_common_device(providers: list[ProviderInfo]) -> str | None:
    """The device most of ``providers`` declare (CloudMesh report 4.10.3); a tie goes GPU > MPS > CPU."""
    counts = Counter(p.device for p in providers)
    if not counts:
        return None
    return min(counts, key=lambda d: (-counts[d], DEVICE_ORDER.get(d, 9), d))


def _set_lost(db: sqlite3.Connection, task_id: str, provider_ids) -> None:
    """Set those of ``provider_ids`` still on ``task_id`` lost (claimed again only once a heartbeat
    says they live), inside the caller's transaction."""
    for provider_id in provider_ids:
        db.execute("UPDATE providers SET status='lost', task=NULL WHERE id=? AND task=?", (provider_id, task_id))


def select(providers: list[ProviderInfo], count: int, device: str = "any", min_ram_gb: float = 0.0,
           min_cores: int = 0, fallback: bool = False, order: list[str] = ()) -> list[ProviderInfo]:
    """Up to ``count`` of ``providers`` for a task, by the rules of docs/network.md ("Choosing providers"):

    - none declaring less RAM than ``min_ram_gb`` or fewer cores than ``min_cores`` (report 4.18.2);
    - a named device (cpu, cuda or gpu, mps): only providers of it (report 4.10.1), unless
      ``fallback``: then those first, others after;
    - ``any``: the device most of them declare first (report 4.10.3), others after;
    - then, within each of those groups, the requester's ``order`` (``--prefer nearest``: by
      round-trip time; report 4.3), then GPU > MPS > CPU, most cores, most RAM, id.
    """
    rank = {provider_id: i for i, provider_id in enumerate(order)}
    fit = [p for p in providers if p.ram_gb >= min_ram_gb and p.cores >= min_cores]
    wanted = wanted_device(device)
    if wanted is not None and not fallback:
        fit = [p for p in fit if p.device == wanted]
    first = wanted or most_common_device(fit)
    fit.sort(key=lambda p: (0 if p.device == first else 1, rank.get(p.id, len(rank)), DEVICE_ORDER.get(p.device, 9),
                            -p.cores, -p.ram_gb, p.id))
    return fit[:count]
