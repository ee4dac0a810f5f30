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
from dataclasses import asdict, dataclass
from pathlib import Path

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import UserInputError

DEVICE_ORDER = {"cuda": 0, "mps": 1, "cpu": 2}
CLAIM_GRACE = 300.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS providers (
    id TEXT PRIMARY KEY, address TEXT NOT NULL, ram_gb REAL NOT NULL, cores INTEGER NOT NULL,
    device TEXT NOT NULL, location TEXT NOT NULL, status TEXT NOT NULL, task TEXT,
    last_seen REAL NOT NULL, registered REAL NOT NULL, claimed_at REAL);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY, requester TEXT NOT NULL, providers TEXT NOT NULL,
    created REAL NOT NULL, status TEXT NOT NULL);
"""


@dataclass
class ProviderInfo:
    """A provider as the registry knows it."""

    id: str
    address: str
    ram_gb: float
    cores: int
    device: str
    location: str
    status: str = "free"  # free | busy | leaving
    task: str | None = None
    last_seen: float = 0.0

    def public(self) -> dict:
        return asdict(self)


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
        except sqlite3.Error as exc:
            self.close()
            raise UserInputError(f"registry {self.path} cannot be used ({exc}): give the file a bootstrap "
                                 "wrote, or a new file name") from None
        return self

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
        self._run(lambda db: db.execute(
            "INSERT INTO providers VALUES (?,?,?,?,?,?,?,?,?,?,NULL) ON CONFLICT(id) DO UPDATE SET "
            "address=excluded.address, ram_gb=excluded.ram_gb, cores=excluded.cores, device=excluded.device, "
            "location=excluded.location, status=excluded.status, task=excluded.task, last_seen=excluded.last_seen",
            (info.id, info.address, info.ram_gb, info.cores, info.device, info.location,
             info.status, info.task, now, now)))

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
        return self._run(lambda db: db.execute("DELETE FROM providers WHERE id=?", (provider_id,)).rowcount == 1)

    def expire(self, ttl: float) -> list[str]:
        """Remove providers without a heartbeat for ``ttl`` seconds; return their ids."""
        cutoff = self.clock.time() - ttl

        def sweep(db):
            gone = [r[0] for r in db.execute("SELECT id FROM providers WHERE last_seen < ?", (cutoff,))]
            db.execute("DELETE FROM providers WHERE last_seen < ?", (cutoff,))
            return gone
        return self._run(sweep)

    def providers(self) -> list[ProviderInfo]:
        """Every registered provider."""
        rows = self._run(lambda db: db.execute(
            "SELECT id,address,ram_gb,cores,device,location,status,task,last_seen FROM providers").fetchall())
        return [ProviderInfo(*row) for row in rows]

    def discover(self, count: int, device: str = "any", location: str | None = None,
                 free_only: bool = True) -> list[ProviderInfo]:
        """Up to ``count`` providers, preferred device first, then GPU > MPS > CPU, then most cores."""
        chosen = [p for p in self.providers()
                  if (not free_only or p.status == "free") and (not location or p.location == location)]
        chosen.sort(key=lambda p: _preference(p, device))
        return chosen[:count]

    def claim(self, task_id: str, requester: str, count: int, device: str = "any",
              location: str | None = None) -> list[ProviderInfo]:
        """Atomically mark up to ``count`` free providers busy with ``task_id`` and record the task."""
        def take(db):
            rows = db.execute("SELECT id,address,ram_gb,cores,device,location,status,task,last_seen "
                              "FROM providers WHERE status='free'").fetchall()
            free = [ProviderInfo(*r) for r in rows if not location or r[5] == location]
            free.sort(key=lambda p: _preference(p, device))
            taken = free[:count]
            for p in taken:
                db.execute("UPDATE providers SET status='busy', task=?, claimed_at=? WHERE id=?",
                           (task_id, self.clock.time(), p.id))
                p.status, p.task = "busy", task_id
            if taken:
                db.execute("INSERT INTO tasks VALUES (?,?,?,?,?)", (
                    task_id, requester, json.dumps([{"id": p.id, "address": p.address} for p in taken]),
                    self.clock.time(), "running"))
            return taken
        return self._run(take)

    def release(self, task_id: str, status: str = "done", lost: list[str] = ()) -> None:
        """Free the providers of a task and record how it ended; forget those the task lost (a
        provider still alive registers again with its next heartbeat)."""
        def free(db):
            for provider_id in lost:
                db.execute("DELETE FROM providers WHERE id=? AND task=?", (provider_id, task_id))
            db.execute("UPDATE providers SET status='free', task=NULL WHERE task=? AND status='busy'", (task_id,))
            db.execute("UPDATE tasks SET status=? WHERE id=?", (status, task_id))
        self._run(free)

    def task(self, task_id: str) -> dict | None:
        """A task's record: requester, providers (id and address), status; None if unknown."""
        row = self._run(lambda db: db.execute(
            "SELECT id,requester,providers,created,status FROM tasks WHERE id=?", (task_id,)).fetchone())
        if row is None:
            return None
        return {"id": row[0], "requester": row[1], "providers": json.loads(row[2]),
                "created": row[3], "status": row[4]}


def _preference(p: ProviderInfo, device: str) -> tuple:
    wanted = {"gpu": "cuda", "any": None}.get(device, device)
    return (0 if wanted and p.device == wanted else 1, DEVICE_ORDER.get(p.device, 9), -p.cores, p.id)
