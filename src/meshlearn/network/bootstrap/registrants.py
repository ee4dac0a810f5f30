"""How many providers one key, or one source address, may keep registered with the bootstrap.

Keys cost a holder of the network secret nothing, so a bound per key alone does not stop an
insider from registering providers by the thousand; a bound per source address does, as far
as addresses cost something. A new provider over either bound takes the place of that key's
or address's *silent* provider heard from longest ago (free, and no heartbeat for half a TTL:
its machine is most likely gone); where every one of them is at work or alive, the newcomer is
refused. A provider registering again (its own id, its own key) is never counted twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from meshlearn.errors import BadMessage

MAX_PROVIDERS_PER_KEY = 4  # a key is one participant: a few providers at most (machines sharing a key)
MAX_PROVIDERS_PER_ADDRESS = 64  # a site's providers share one address (NAT)


class Registered(Protocol):
    """What ``Registrants`` reads of a registered provider (``registry.ProviderInfo``)."""

    id: str
    key: str
    status: str
    last_seen: float


class Registrants:
    """The source address each registered provider last spoke from, and the bounds per key and
    per address on new registrations. Pure bookkeeping: the bootstrap removes whom it evicts."""

    def __init__(self, per_key: int = MAX_PROVIDERS_PER_KEY, per_address: int = MAX_PROVIDERS_PER_ADDRESS):
        self.per_key = per_key
        self.per_address = per_address
        self._source: dict[str, str] = {}  # provider id -> the address it last registered or beat from

    def seen(self, provider_id: str, source: str) -> None:
        """A registered provider spoke from ``source`` (a heartbeat)."""
        if source and provider_id in self._source:
            self._source[provider_id] = source

    def make_room(self, provider_id: str, key: str, source: str, registered: Iterable[Registered],
                  silent_before: float) -> list[str]:
        """Admit ``provider_id`` registering with ``key`` from ``source``: the ids of the silent
        providers (last heard from before ``silent_before``, not at work) it evicts to stay within
        the bounds; BadMessage where a bound is full of live ones. ``registered``: every provider
        registered now. (Plain mode, with no keys, is bounded per address only.)"""
        registered = list(registered)
        others = [p for p in registered if p.id != provider_id]
        self._source = {p.id: self._source[p.id] for p in others if p.id in self._source}  # the gone forgotten
        if len(others) < len(registered):
            self._source[provider_id] = source or self._source.get(provider_id, "")
            return []  # registering again: already counted
        evicted: list[str] = []
        groups = []
        if key:
            groups.append(([p for p in others if p.key == key], self.per_key,
                           f"this key keeps {self.per_key} providers registered already, all alive or at work: "
                           "stop one (meshlearn leave) or give this one its own key"))
        if source:
            groups.append(([p for p in others if self._source.get(p.id) == source], self.per_address,
                           f"{source} keeps {self.per_address} providers registered already, all alive or at work: "
                           "stop one first"))
        for group, most, full in groups:
            group = [p for p in group if p.id not in evicted]
            if len(group) < most:
                continue
            silent = [p for p in group if p.status != "busy" and p.last_seen < silent_before]
            if not silent:
                raise BadMessage(full)
            evicted.append(min(silent, key=lambda p: p.last_seen).id)
        for gone in evicted:
            self._source.pop(gone, None)
        if source:
            self._source[provider_id] = source
        return evicted
