"""Who may use the bootstrap's relay, and how participants are reached: dialing an announced
address back (``probe``, and each registration), relay allocations for registered work only
(``relay.open``, ``relay.close``), and closing those whose work ended."""

from __future__ import annotations

import logging
import socket

from meshlearn.errors import BadMessage, NetworkError
from meshlearn.network.bootstrap.claims import takes_part
from meshlearn.network.bootstrap.registry import Registry
from meshlearn.network.channel.addresses import is_wildcard
from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import KeyPair, pinned
from meshlearn.network.channel.relay import Relay
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import (
    Probe,
    Probed,
    RelayClose,
    RelayClosed,
    RelayOpen,
    RelayOpened,
)
from meshlearn.network.protocol.message import Empty
from meshlearn.network.protocol.serving import ask

log = logging.getLogger(__name__)
MAX_REGISTERING = 4096  # (key, provider id) pairs remembered as registering through the relay, the oldest forgotten first
PROBE_TIMEOUT = 3.0  # seconds the bootstrap waits when it dials a participant back


class RelayAccess:
    """Admits relay allocations to registered work (a provider told to register through the
    relay, or a running task the caller is part of), tells how an announced address is reached,
    and releases the allocations of work that ended. ``dial_back`` False: every address counts as
    reachable (no dial)."""

    def __init__(self, relay: Relay, registry: Registry, secret: bytes, keys: KeyPair | None, dial_back: bool):
        self.relay = relay
        self.registry = registry
        self.secret = secret
        self.keys = keys
        self.dial_back = dial_back
        self._registering: dict[tuple[str, str], bool] = {}  # (key, provider id) told to come back through the relay

    def probe(self, message: Probe, req: Envelope) -> Probed:
        """Can this bootstrap dial ``address`` back (a requester's data server, proving the caller's key)?"""
        return Probed(reachable=self.reach(message.address, req, rpcs.REQUESTER_PING) is not None,
                      relay=self.relay.address)

    def reach(self, address: str, req: Envelope, ping: rpcs.Rpc) -> str | None:
        """How peers reach ``address``, announced by the caller of ``req``: "direct" (dialed back
        with ``ping``, the ``ping`` of the server the caller announces, and the caller's key
        answered), "relayed" (a live relay allocation of the caller's), or None. Only the caller's
        own IP address is dialed: the bootstrap never dials a third party."""
        host, sep, port = address.rpartition(":")
        if not sep or is_wildcard(host) or not port.isdigit():
            raise BadMessage(f"address {address!r} is not one peers can connect to: start it with --advertise HOST "
                             "(the address other machines reach it at)")
        owner = self.relay.owner_of(address)
        if owner is not None:
            return "relayed" if owner == req.caller else None
        if not self.dial_back:
            return "direct"
        if req.peer_address and not _is_host(host, req.peer_address):
            log.info("%s is not where the request came from (%s): not dialed", address, req.peer_address)
            return None
        try:
            ask(pinned(address, req.peer_key), ping, Empty(), self.secret, timeout=PROBE_TIMEOUT, sender="bootstrap",
                keys=self.keys)
            return "direct"
        except NetworkError as exc:  # a reply that does not fit (BadMessage) too: nothing named itself there
            log.info("%s cannot be reached from here (%s)", address, exc)
            return None

    def open(self, message: RelayOpen, req: Envelope) -> RelayOpened:
        """A relay allocation for the caller (behind NAT), for registered work only: the provider
        it registers (told to come back through the relay) or a running task it is part of. Its
        token and public address."""
        holder, settled = self._holder(message, req)
        token, address = self.relay.allocate(req.caller, req.peer_address, holder, settled)
        log.info("relay: port %s allocated to key %s for %s", address.rpartition(":")[2], req.caller, holder)
        return RelayOpened(token=token, address=address, relay=self.relay.address)

    def close(self, message: RelayClose, req: Envelope) -> RelayClosed:
        """The caller gives back one of its allocations (a task's engine that ended)."""
        return RelayClosed(closed=self.relay.release(message.token, req.caller))

    def _holder(self, message: RelayOpen, req: Envelope) -> tuple[Holder, bool]:
        """What the allocation ``message`` asks for serves (its task if it names one, else its
        provider), and whether that work is registered already; refused (BadMessage) unless the
        caller registers that provider or is part of that task."""
        caller = req.caller
        if message.task is not None:
            task_id = message.task
            record = self.registry.task(task_id)
            if record is None or record["status"] != "running" or not takes_part(record, caller):
                raise BadMessage(f"task {task_id!r} is not a running task this key requested or was claimed for: "
                                 "the relay serves registered work only")
            return Holder("task", task_id), True
        if message.provider is None:
            raise BadMessage("relay.open names the provider this key registers or a task it is part of: the relay "
                             "serves registered work only")
        provider_id = message.provider
        known = self.registry.key_of(provider_id)
        if known is None and (caller, provider_id) not in self._registering:
            raise BadMessage(f"provider {provider_id!r} is not registering with this key: register first (the relay "
                             "serves registered providers and claimed tasks only)")
        if known is not None and known != caller:
            raise BadMessage(f"provider {provider_id} is registered with another key")
        return Holder("provider", provider_id), known is not None

    def registering(self, key: str, provider_id: str) -> None:
        """Remember that ``key`` was told to register ``provider_id`` through the relay (what
        entitles it to one allocation), forgetting the oldest beyond MAX_REGISTERING."""
        self._registering.pop((key, provider_id), None)
        self._registering[(key, provider_id)] = True
        while len(self._registering) > MAX_REGISTERING:
            del self._registering[next(iter(self._registering))]

    def registered(self, key: str, provider_id: str) -> None:
        """``key`` registered ``provider_id``: it is no longer one coming back through the relay."""
        self._registering.pop((key, provider_id), None)

    def release_ended_work(self) -> None:
        """Close the relay allocations of providers no longer registered and of tasks no longer running."""
        for holder in self.relay.holders(settled=True):
            if holder.kind == "provider":
                ended = self.registry.key_of(holder.name) is None
            else:
                record = self.registry.task(holder.name)
                ended = record is None or record["status"] != "running"
            if ended and self.relay.release_holder(holder):
                log.info("relay: allocations of %s closed (its work ended)", holder)


def _is_host(host: str, address: str) -> bool:
    """Whether ``host`` (an address or a name) is ``address``."""
    if host == address:
        return True
    try:
        return address in {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False
