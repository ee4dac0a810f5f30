"""The bootstrap's registry of providers and tasks: its rules, stated once for every store.

Claims are atomic: two requesters racing for the same provider are serialized by the store (one
SQLite transaction, or one etcd transaction checked against concurrent writes), and the loser sees
it busy. A claimed provider stays busy until it reports that it ran the task, the task is released,
or CLAIM_GRACE passes without the requester showing up (its heartbeats saying "free" in between do
not free it).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from pathlib import Path

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage
from meshlearn.network.bootstrap.registrystore import (
    EtcdLocation,
    ProviderInfo,
    RegistryStore,
    RegistryTx,
    TaskRecord,
)
from meshlearn.network.task.resources import DEVICE_ORDER, wanted_device

CLAIM_GRACE = 300.0
__all__ = ["CLAIM_GRACE", "ProviderInfo", "Registry", "most_common_device", "open_store", "select"]


def open_store(where: str | Path | EtcdLocation | RegistryStore) -> RegistryStore:
    """The store a registry at ``where`` is kept in: a SQLite file's path, an etcd cluster, or a
    store made already (not opened yet)."""
    if isinstance(where, EtcdLocation):
        from meshlearn.network.bootstrap.etcdstore import EtcdStore

        return EtcdStore(where)
    if isinstance(where, (str, Path)):
        from meshlearn.network.bootstrap.sqlitestore import SqliteStore

        return SqliteStore(where)
    return where


class Registry:
    """Providers (with resources and heartbeats), claimed tasks, revoked keys and the history of
    them, kept in a ``RegistryStore`` (a SQLite file by default)."""

    def __init__(self, where: str | Path | EtcdLocation | RegistryStore = ":memory:", clock: Clock = SYSTEM):
        self.store = open_store(where)
        self.clock = clock  # wall time: timestamps are stored and outlive a restart

    def open(self) -> "Registry":
        """Open (creating if needed) the store."""
        self.store.open()
        return self

    @property
    def is_open(self) -> bool:
        return self.store.is_open

    def close(self) -> None:
        self.store.close()

    def register(self, info: ProviderInfo) -> None:
        """Add or refresh a provider (a re-registration keeps a task it still runs)."""
        now = self.clock.time()

        def add(tx: RegistryTx) -> None:
            known = tx.provider(info.id)
            if known is None or known.address != info.address:
                tx.note(now, "registered", info.id, f"{info.address} ({info.device}, {info.cores} cores, "
                        f"{info.ram_gb:g} GB{', ' + info.location if info.location else ''}"
                        f"{'' if info.reachable else ', through the relay'})")
            tx.put_provider(ProviderInfo(**{**asdict(info), "last_seen": now,
                                            "registered": known.registered if known else now,
                                            "claimed_at": known.claimed_at if known else None}))
        self.store.write(add)

    def drop_unverified(self, keys_required: bool, relay: str = "") -> list[str]:
        """Forget providers that must register again after a bootstrap's restart: those reached
        through its relay (``relay``: its key; the allocations died with the process) or a relay
        no registry recorded, and, with ``keys_required``, those that never proved a key (a
        registry written before keys). Returns their ids."""
        def drop(tx: RegistryTx) -> list[str]:
            gone = [p.id for p in tx.providers()
                    if (not p.reachable and p.relay in ("", relay)) or (keys_required and not p.key)]
            for provider_id in gone:
                tx.delete_provider(provider_id)
            return gone
        return self.store.write(drop)

    def key_of(self, provider_id: str) -> str | None:
        """The key a provider registered with (None if it is not registered)."""
        known = self.store.read(lambda tx: tx.provider(provider_id))
        return None if known is None else known.key

    def revoke(self, key: str) -> list[str]:
        """Shut ``key`` out: refused on every new connection from now on, its providers forgotten."""
        def shut(tx: RegistryTx) -> list[str]:
            gone = [p.id for p in tx.providers() if p.key == key]
            for provider_id in gone:
                tx.delete_provider(provider_id)
            tx.revoke(key, self.clock.time())
            tx.note(self.clock.time(), "revoked", key, "providers forgotten: " + (", ".join(gone) or "none"))
            return gone
        return self.store.write(shut)

    def is_revoked(self, key: str) -> bool:
        return self.store.read(lambda tx: tx.is_revoked(key))

    def revoked(self) -> list[str]:
        """Every revoked key (providers refuse them too, told with each heartbeat)."""
        return self.store.read(lambda tx: tx.revoked())

    def heartbeat(self, provider_id: str, status: str, task: str | None, last_task: str | None = None) -> bool:
        """Record that a provider is alive and what it is doing; False if it is not registered.

        A provider claimed for a task it has not started yet stays busy (see CLAIM_GRACE).
        """
        def beat(tx: RegistryTx) -> bool:
            known = tx.provider(provider_id)
            if known is None:
                return False
            now = self.clock.time()
            new_status, new_task = status, task
            if known.status == "busy" and status == "free" and known.task and known.task != last_task \
                    and now - (known.claimed_at or 0.0) < CLAIM_GRACE:
                new_status, new_task = "busy", known.task  # claimed, the requester has not assigned it yet
            known.last_seen, known.status, known.task = now, new_status, new_task
            tx.put_provider(known)
            return True
        return self.store.write(beat)

    def remove(self, provider_id: str) -> bool:
        """Forget a provider (it left); False if it was not registered."""
        def leave(tx: RegistryTx) -> bool:
            if tx.provider(provider_id) is None:
                return False
            tx.delete_provider(provider_id)
            tx.note(self.clock.time(), "left", provider_id, "")
            return True
        return self.store.write(leave)

    def left_since(self, provider_ids: list[str], since: float) -> list[str]:
        """Those of ``provider_ids`` that left the network (``meshlearn leave``, Ctrl-C) at or after
        ``since``, by the registry's history."""
        if not provider_ids:
            return []
        return self.store.read(lambda tx: tx.left_since(list(provider_ids), since))

    def expire(self, ttl: float) -> list[str]:
        """Remove providers without a heartbeat for ``ttl`` seconds; return their ids."""
        def sweep(tx: RegistryTx) -> list[str]:
            cutoff = self.clock.time() - ttl
            gone = [p.id for p in tx.providers() if p.last_seen < cutoff]
            for provider_id in gone:
                tx.delete_provider(provider_id)
                tx.note(self.clock.time(), "expired", provider_id, f"no heartbeat for {ttl:g} s")
            return gone
        return self.store.write(sweep)

    def providers(self) -> list[ProviderInfo]:
        """Every registered provider."""
        return self.store.read(lambda tx: tx.providers())

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
              min_cores: int = 0, fallback: bool = False, order: list[str] = (), attempt: str = "") -> list[ProviderInfo]:
        """Atomically mark up to ``count`` free providers (as ``select`` chooses them) busy with
        ``task_id`` and record the task, bound to ``requester_key`` (the key that claimed it: the
        only one that may act on it). ``order``: the ids the requester prefers, first first (say,
        by round-trip time). A task claimed before, and not done, is claimed again by the key that
        claimed it (a task resumed after its processes died): its providers of then that are still
        marked busy with it are lost to it, and the claim records the new ones (BadMessage for
        another key's task, or one that is done). ``attempt``: the requester's name for this claim;
        the claim that last took the task's providers, sent again, gets those providers again."""
        def take(tx: RegistryTx) -> list[ProviderInfo]:
            earlier = tx.task(task_id)
            if earlier is not None:
                if earlier.requester_key != requester_key:
                    raise BadMessage(f"task {task_id} was claimed by another key")
                if attempt and earlier.attempt == attempt and earlier.status == "running":
                    return _members(tx, earlier)
                if earlier.status == "done":
                    raise BadMessage(f"task {task_id} is done: it cannot be claimed again")
                _set_lost(tx, task_id, [p.id for p in tx.providers() if p.task == task_id and p.status == "busy"])
            taken = self._take_free(tx, task_id, (), location,
                                    lambda free: select(free, count, device, min_ram_gb, min_cores, fallback, order))
            if taken:
                members = [{"id": p.id, "address": p.pinned_address} for p in taken]
                if earlier is None:
                    earlier = TaskRecord(task_id, requester, created=self.clock.time(), requester_key=requester_key)
                    kind = "claimed"
                else:
                    kind = "claimed again"
                earlier.providers, earlier.status, earlier.attempt = members, "running", attempt
                tx.put_task(earlier)
                tx.note(self.clock.time(), kind, task_id, f"by {requester}: " + ", ".join(p.id for p in taken))
            return taken
        return self.store.write(take)

    def replace(self, task_id: str, drop: list[str], count: int, device: str = "any", location: str | None = None,
                exclude: list[str] = (), min_ram_gb: float = 0.0, min_cores: int = 0,
                fallback: bool = False) -> list[ProviderInfo]:
        """Take ``drop`` out of a running task (each set ``lost``: claimed again only once its next
        heartbeat says it lives) and, in the same transaction, claim up to ``count`` free providers
        in their place, never one of ``exclude`` (the task's earlier drops); the task's record then
        lists its providers as they are now (so a dropped one may no longer act on it)."""
        def swap(tx: RegistryTx) -> list[ProviderInfo]:
            record = tx.task(task_id)
            if record is None or record.status != "running":
                return []
            _set_lost(tx, task_id, drop)
            skip = set(drop) | set(exclude)
            taken = self._take_free(tx, task_id, skip, location,
                                    lambda free: select(free, count, device, min_ram_gb, min_cores, fallback))
            record.providers = [m for m in record.providers if m["id"] not in skip]
            record.providers += [{"id": p.id, "address": p.pinned_address} for p in taken]
            tx.put_task(record)
            tx.note(self.clock.time(), "replaced", task_id,
                    f"{', '.join(drop)} by " + (", ".join(p.id for p in taken) or "none"))
            return taken
        return self.store.write(swap)

    def _take_free(self, tx: RegistryTx, task_id: str, skip: set[str] | tuple, location: str | None,
                   choose) -> list[ProviderInfo]:
        """Mark busy with ``task_id`` the free providers (at ``location``, none of ``skip``) that
        ``choose`` picks from them, inside the caller's transaction; returns them."""
        free = [p for p in tx.providers()
                if p.status == "free" and p.id not in skip and (not location or p.location == location)]
        taken = choose(free)
        for p in taken:
            p.status, p.task, p.claimed_at = "busy", task_id, self.clock.time()
            tx.put_provider(p)
        return taken

    def release(self, task_id: str, status: str = "done", lost: list[str] = ()) -> None:
        """Free the providers of a task and record how it ended. Those the task lost are set
        ``lost``: never claimed until their next heartbeat says they live (a dead one expires),
        and still bound to their key, so nobody else can register their ids meanwhile."""
        def free(tx: RegistryTx) -> None:
            _set_lost(tx, task_id, lost)
            for p in tx.providers():
                if p.task == task_id and p.status == "busy":
                    p.status, p.task = "free", None
                    tx.put_provider(p)
            record = tx.task(task_id)
            if record is not None:
                record.status = status
                tx.put_task(record)
                tx.note(self.clock.time(), "released", task_id, status + (f"; lost {', '.join(lost)}" if lost else ""))
        self.store.write(free)

    def task(self, task_id: str) -> dict | None:
        """A task's record: requester (name and key), providers (id and pinned address), status;
        None if unknown."""
        record = self.store.read(lambda tx: tx.task(task_id))
        return None if record is None else asdict(record)

    def tasks(self, limit: int = 50) -> list[dict]:
        """The latest ``limit`` tasks' records, newest first."""
        return [asdict(record) for record in self.store.read(lambda tx: tx.tasks(limit))]

    def history(self, limit: int = 200) -> list[dict]:
        """The registry's latest ``limit`` events (registered, left, expired, revoked, claimed,
        released), newest first: {"at", "kind", "subject", "detail"}."""
        return self.store.read(lambda tx: tx.history(limit))


def most_common_device(providers: list[ProviderInfo]) -> str | None:
    """The device most of ``providers`` declare (CloudMesh report 4.10.3); a tie goes GPU > MPS > CPU."""
    counts = Counter(p.device for p in providers)
    if not counts:
        return None
    return min(counts, key=lambda d: (-counts[d], DEVICE_ORDER.get(d, 9), d))


def _members(tx: RegistryTx, record: TaskRecord) -> list[ProviderInfo]:
    """The providers ``record`` lists that are still busy with its task."""
    found = (tx.provider(member["id"]) for member in record.providers)
    return [p for p in found if p is not None and p.task == record.id and p.status == "busy"]


def _set_lost(tx: RegistryTx, task_id: str, provider_ids) -> None:
    """Set those of ``provider_ids`` still on ``task_id`` lost (claimed again only once a heartbeat
    says they live), inside the caller's transaction."""
    for provider_id in provider_ids:
        known = tx.provider(provider_id)
        if known is not None and known.task == task_id:
            known.status, known.task = "lost", None
            tx.put_provider(known)


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
