"""The registry in one SQLite file, for one bootstrap: nothing else to run, and a restart loses nothing.

Each write runs in one ``BEGIN IMMEDIATE`` transaction, so two requesters racing for the same
provider are serialized by SQLite, here or in another process holding the same file
(``meshlearn revoke`` does); the loser sees the winner's writes.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path

from meshlearn.errors import UserInputError
from meshlearn.network.bootstrap.registrystore import HISTORY_KEPT, ProviderInfo, T, TaskRecord

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
# columns added since the first registry files, with their defaults for rows written before
_ADDED = {"providers": [("key", "TEXT NOT NULL DEFAULT ''"), ("reachable", "INTEGER NOT NULL DEFAULT 1"),
                        ("relay", "TEXT NOT NULL DEFAULT ''")],
          "tasks": [("requester_key", "TEXT NOT NULL DEFAULT ''"), ("attempt", "TEXT NOT NULL DEFAULT ''")]}
_COLUMNS = "id,address,ram_gb,cores,device,location,status,task,last_seen,key,reachable,registered,claimed_at,relay"
_TASK_COLUMNS = "id,requester,providers,created,status,requester_key,attempt"
PRUNE_EVERY = 500  # history rows between two prunings


class SqliteStore:
    """The registry's records in the tables of one SQLite file (``:memory:`` for tests)."""

    def __init__(self, path: str | Path = ":memory:"):
        self.path = str(path)
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    def open(self) -> None:
        """Open (creating if needed) the database, adding the columns of later versions."""
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

    @property
    def is_open(self) -> bool:
        return self._db is not None

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def describe(self) -> str:
        return self.path

    def write(self, fn: Callable[[_Tables], T]) -> T:
        assert self._db is not None, "Registry.open() first"
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(_Tables(self._db))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            return result

    read = write  # a read in BEGIN IMMEDIATE sees every commit before it, and nothing half-done


class _Tables:
    """One transaction's reads and writes, as SQL on the open connection."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db

    def provider(self, provider_id: str) -> ProviderInfo | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM providers WHERE id=?", (provider_id,)).fetchone()
        return None if row is None else _provider(row)

    def providers(self) -> list[ProviderInfo]:
        return [_provider(row) for row in self.db.execute(f"SELECT {_COLUMNS} FROM providers ORDER BY id")]

    def put_provider(self, p: ProviderInfo) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO providers ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        (p.id, p.address, p.ram_gb, p.cores, p.device, p.location, p.status, p.task, p.last_seen,
                         p.key, int(p.reachable), p.registered, p.claimed_at, p.relay))

    def delete_provider(self, provider_id: str) -> None:
        self.db.execute("DELETE FROM providers WHERE id=?", (provider_id,))

    def task(self, task_id: str) -> TaskRecord | None:
        row = self.db.execute(f"SELECT {_TASK_COLUMNS} FROM tasks WHERE id=?", (task_id,)).fetchone()
        return None if row is None else _task(row)

    def tasks(self, limit: int) -> list[TaskRecord]:
        rows = self.db.execute(f"SELECT {_TASK_COLUMNS} FROM tasks ORDER BY created DESC LIMIT ?", (limit,))
        return [_task(row) for row in rows]

    def put_task(self, t: TaskRecord) -> None:
        self.db.execute(f"INSERT OR REPLACE INTO tasks ({_TASK_COLUMNS}) VALUES (?,?,?,?,?,?,?)",
                        (t.id, t.requester, json.dumps(t.providers), t.created, t.status, t.requester_key,
                         t.attempt))

    def revoked(self) -> list[str]:
        return [row[0] for row in self.db.execute("SELECT key FROM revoked ORDER BY at")]

    def is_revoked(self, key: str) -> bool:
        return self.db.execute("SELECT 1 FROM revoked WHERE key=?", (key,)).fetchone() is not None

    def revoke(self, key: str, at: float) -> None:
        self.db.execute("INSERT OR REPLACE INTO revoked VALUES (?,?)", (key, at))

    def note(self, at: float, kind: str, subject: str, detail: str) -> None:
        seq = self.db.execute("INSERT INTO history (at,kind,subject,detail) VALUES (?,?,?,?)",
                              (at, kind, subject, detail)).lastrowid
        if seq % PRUNE_EVERY == 0:
            self.db.execute("DELETE FROM history WHERE seq <= ?", (seq - HISTORY_KEPT,))

    def history(self, limit: int) -> list[dict]:
        rows = self.db.execute("SELECT at,kind,subject,detail FROM history ORDER BY seq DESC LIMIT ?", (limit,))
        return [{"at": r[0], "kind": r[1], "subject": r[2], "detail": r[3]} for r in rows]

    def left_since(self, provider_ids: list[str], since: float) -> list[str]:
        if not provider_ids:
            return []
        marks = ",".join("?" * len(provider_ids))
        rows = self.db.execute(f"SELECT DISTINCT subject FROM history WHERE kind='left' AND at>=? AND subject IN "
                               f"({marks})", (since, *provider_ids))
        return sorted(r[0] for r in rows)


def _provider(row: tuple) -> ProviderInfo:
    return ProviderInfo(*row[:10], reachable=bool(row[10]), registered=row[11], claimed_at=row[12], relay=row[13])


def _task(row: tuple) -> TaskRecord:
    return TaskRecord(id=row[0], requester=row[1], providers=json.loads(row[2]), created=row[3], status=row[4],
                      requester_key=row[5], attempt=row[6])
