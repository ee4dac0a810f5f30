"""The bootstrap node: entry point of the network and registry of providers (``meshlearn bootstrap``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from pydantic import Field

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage, ServiceUnavailable, UserInputError
from meshlearn.network.bootstrap.claims import Claims
from meshlearn.network.bootstrap.registrants import Registrants
from meshlearn.network.bootstrap.registry import ProviderInfo, Registry
from meshlearn.network.bootstrap.registrystore import EtcdLocation, parse_registry
from meshlearn.network.bootstrap.relayaccess import RelayAccess
from meshlearn.network.bootstrap.taskboard import TaskBoard
from meshlearn.network.channel.addresses import is_wildcard, reachable_hosts
from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.filelimit import raise_open_file_limit
from meshlearn.network.channel.identity import (
    KeyPair,
    fingerprint,
    key_from_text,
    key_text,
)
from meshlearn.network.channel.reflector import Reflector
from meshlearn.network.channel.relay import Relay
from meshlearn.network.channel.rpc import RpcServer
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import (
    Heartbeat,
    HeartbeatAnswer,
    Left,
    Named,
    ProviderId,
    Register,
    Registered,
)
from meshlearn.network.protocol.message import Empty
from meshlearn.network.protocol.rpcs import Server
from meshlearn.network.protocol.serving import serve
from meshlearn.settings import Settings
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)
SWEEP_EVERY = 1.0  # seconds between sweeps for providers whose heartbeat stopped


class BootstrapSettings(Settings):
    """Where the bootstrap listens, where it keeps its registry, and how long a heartbeat lasts."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all)")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on")
    state: str = Field("meshlearn-bootstrap.sqlite", description="SQLite file of the registry")
    registry: str = Field("", description="etcd://HOST:PORT[,HOST:PORT...]: keep the registry in this etcd cluster, "
                          "shared with the network's other bootstraps (default: the SQLite file --state)")
    registry_tls: str = Field("", description="folder of the etcd cluster's certificates (ca.crt, client.crt, "
                              "client.key), where it requires TLS (default: none, plain HTTP)")
    ttl: float = Field(30.0, gt=0, description="seconds without a heartbeat before a provider is dropped")
    # Not the engine's message cap (max_message_mb): the registry's requests (registrations,
    # heartbeats, claims) are small JSON, so its RPC server refuses anything above this, in bytes.
    max_request_bytes: int = Field(1024 * 1024, gt=0, description="largest RPC request accepted, in bytes")
    key: str = Field("", description="file of this bootstrap's key pair, made on first start (default: "
                     "bootstrap.key next to --state)")
    advertise: str = Field("", description="address other machines reach this bootstrap and its relay at "
                           "(default: --host; with 0.0.0.0, this machine's first non-loopback address)")
    relay_port: int | None = Field(None, ge=0, le=65535, description="port of the relay, where participants "
                                   "behind NAT park their connections (default: --port + 1)")
    dial_back: bool = Field(True, description="dial each registering provider back, and send those it cannot reach "
                            "through the relay")
    relay_ports: str = Field("", description="FIRST-LAST: ports the relay may give participants behind NAT, "
                             "two per provider at work (default: any free port)")
    dashboard: str = Field("", description="[HOST:]PORT of a read-only live web page of the network (loopback "
                           "unless HOST is given; other machines then need its token) (default: none)")
    dashboard_token: str = Field("", description="token other machines open the dashboard with (default: one "
                                 "derived from the network secret, printed at start)")

    def key_file(self) -> Path:
        return Path(self.key) if self.key else Path(self.state).parent / "bootstrap.key"

    def registry_location(self) -> Path | EtcdLocation:
        """Where the registry is kept: the SQLite file --state, or the etcd cluster --registry."""
        if not self.registry:
            if self.registry_tls:
                raise UserInputError("--registry-tls is for an etcd cluster: give --registry etcd://... too")
            return Path(self.state)
        return parse_registry(self.registry, self.registry_tls)

    def relay_port_range(self) -> range | None:
        if not self.relay_ports:
            return None
        first, sep, last = self.relay_ports.partition("-")
        if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last) <= 65535):
            raise UserInputError(f"--relay-ports {self.relay_ports!r} is not FIRST-LAST (e.g. 9000-9099)")
        return range(int(first), int(last) + 1)

    def public_host(self) -> str:
        if self.advertise:
            return self.advertise
        return reachable_hosts()[0] if is_wildcard(self.host) else self.host


class Bootstrap:
    """Serves registration, heartbeats, discovery and atomic claims; expires silent providers. The
    facade of the bootstrap: the relay's admission (``RelayAccess``) and the requesters' task
    requests (``Claims``) are served by its collaborators."""

    def __init__(self, settings: BootstrapSettings, secret: bytes, keys: KeyPair | None = None,
                 clock: Clock = SYSTEM):
        self.settings = settings
        self.secret = secret
        self.keys = keys  # None: plain ZeroMQ, for tests on loopback only
        self.clock = clock
        self.where = settings.registry_location()  # the SQLite file, or the etcd cluster
        self.registry = Registry(self.where, clock)
        self.tasks = TaskBoard(clock)
        relay_port = (settings.port + 1 if settings.port else 0) if settings.relay_port is None else settings.relay_port
        self.relay = Relay(settings.host, relay_port, settings.public_host(), keys.text if keys else "",
                           settings.relay_port_range())
        # Reflexive addresses over UDP, on the same port numbers as the bootstrap's and the relay's TCP
        # ports: peers behind NAT already know them, so no new setting (bound in run()).
        self.reflector = Reflector(settings.host)
        self.relay_access = RelayAccess(self.relay, self.registry, secret, keys, settings.dial_back)
        self.claims = Claims(self.registry, self.tasks)
        self.server = RpcServer("bootstrap", settings.host, settings.port, secret, serve(Server.BOOTSTRAP, {
            rpcs.BOOTSTRAP_PING: self._ping,
            rpcs.REGISTER: self._register,
            rpcs.HEARTBEAT: self._heartbeat,
            rpcs.LEAVE: self._leave,
            rpcs.DISCOVER: self.claims.discover,
            rpcs.CLAIM: self.claims.claim,
            rpcs.CLAIM_REPLACE: self.claims.claim_replace,
            rpcs.RELEASE: self.claims.release,
            rpcs.TASK: self.claims.task,
            rpcs.PROBE: self.relay_access.probe,
            rpcs.RELAY_OPEN: self.relay_access.open,
            rpcs.RELAY_CLOSE: self.relay_access.close,
            rpcs.TASK_PROGRESS: self.claims.task_progress,
        }), max_bytes=settings.max_request_bytes, keys=keys, admit=self._admit)
        self.registrants = Registrants()
        self._stop = threading.Event()
        self._warn = SparseLog(log)  # refused revoked keys, by key
        self._revoked: frozenset[str] = frozenset()  # as the registry last said (``_sweep``)

    def run(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()``: bind, open the registry, sweep expired providers every second.
        Binding comes first, so a port in use leaves nothing behind (no new state file)."""
        raise_open_file_limit()
        relay_chosen = not self.relay.port  # 0: the relay takes any free port (as the server with --port 0)
        self.server.bind()
        try:
            self.relay.bind()
            self.reflector.bind(self.server.port, required=bool(self.settings.port))
            self.reflector.bind(self.relay.port, required=not relay_chosen)
            self._open_registry()
        except BaseException:
            self.server.stop()
            self.relay.stop()
            self.reflector.stop()
            raise
        try:
            self.server.start()
            self.relay.start()
            self.reflector.start()
            log.info("bootstrap listening on %s, relay on %s (registry %s, %d provider(s) restored)",
                     self.server.address, self.relay.port, self.registry.store.describe(),
                     len(self.registry.providers()))
            if ready is not None:
                ready.set()
            while not self.clock.wait(self._stop, SWEEP_EVERY):
                self.server.check()
                self._sweep()
        finally:
            self.server.stop()
            self.relay.stop()
            self.reflector.stop()
            self.registry.close()

    @property
    def address(self) -> str:
        """``HOST:PORT@KEY`` that providers and requesters give as ``--bootstrap``."""
        return self.server.reached_at(self.relay.public_host)

    def _sweep(self) -> None:
        """Expire providers whose heartbeats stopped, learn the revoked keys (refused at admission
        even while a shared registry has no majority), and close the relay allocations of work that
        ended; while the registry cannot be reached, say so (sparsely) and serve on."""
        try:
            for gone in self.registry.expire(self.settings.ttl):
                log.info("provider %s expired (no heartbeat for %g s)", gone, self.settings.ttl)
            self._revoked = frozenset(self.registry.revoked())
            self.relay_access.release_ended_work()
        except ServiceUnavailable as exc:
            self._warn.warning("registry", "the registry cannot be reached: %s (peers are told to ask another "
                               "bootstrap)", exc)

    @property
    def relay_identity(self) -> str:
        """What the registry records of a provider relayed here: this bootstrap's key (its address
        in plain mode), the same across its restarts."""
        return self.keys.text if self.keys is not None else f"{self.settings.host}:{self.settings.port}"

    def _open_registry(self) -> None:
        if isinstance(self.where, Path) and self.settings.state != ":memory:":
            folder = Path(self.settings.state).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserInputError(f"--state {self.settings.state}: cannot make its folder {folder} "
                                     f"({exc.strerror}): give a path in a folder you can write") from None
        self.registry.open()
        dropped = self.registry.drop_unverified(keys_required=self.keys is not None, relay=self.relay_identity)
        self._revoked = frozenset(self.registry.revoked())
        if dropped:  # their relay allocations died with the last run, or they never proved a key
            log.info("%d provider(s) of the last run must register again: %s", len(dropped), ", ".join(dropped))

    def stop(self) -> None:
        self._stop.set()

    def _admit(self, key: bytes) -> bool:
        """ZAP's question for each new connection: is this key shut out? (Any other key may ask to
        register: the network secret it must sign with admits it.)"""
        try:
            revoked = self.registry.is_revoked(key_text(key))
        except ServiceUnavailable:  # the keys revoked when the registry last answered: every request of
            revoked = key_text(key) in self._revoked  # this key is then refused as unavailable anyway
        if revoked:
            self._warn.warning(key_text(key), "refused a connection from revoked key %s", key_text(key))
            return False
        return True

    def _same_key(self, req: Envelope, provider_id: str) -> None:
        """Only the key a provider registered with may speak for it (heartbeats, leaving)."""
        known = self.registry.key_of(provider_id)
        if known is not None and known != req.caller:
            log.warning("refused %s for provider %s from another key (%s)", req.kind, provider_id, req.caller)
            raise BadMessage(f"provider {provider_id} is registered with another key")

    def _ping(self, message: Empty, req: Envelope) -> Named:
        return Named(service="bootstrap")

    def _register(self, message: Register, req: Envelope) -> Registered:
        info = ProviderInfo(id=message.id, address=message.address, ram_gb=message.ram_gb, cores=message.cores,
                            device=message.device, location=message.location, status=message.status,
                            task=message.task)
        self._same_key(req, info.id)
        info.key = req.caller
        reach = self.relay_access.reach(info.address, req, rpcs.PROVIDER_PING)
        if reach == "relayed" and not self.relay.settle(info.address, info.key, Holder("provider", info.id)):
            reach = None  # an allocation opened for other work: this provider needs its own
        if reach is None:  # not recorded: it comes back with a relay allocation
            self.relay_access.registering(info.key, info.id)
            return Registered(registered=None, reachable=False, relay=self.relay.address, ttl=self.settings.ttl)
        self._make_room_for(info, req.peer_address)
        info.reachable = reach == "direct"
        info.relay = "" if info.reachable else self.relay_identity
        self.registry.register(info)
        self.relay_access.registered(info.key, info.id)
        how = "reachable" if info.reachable else "through the relay"
        log.info("provider %s registered at %s, %s (%s, %d cores, %.1f GB, key %s)", info.id, info.address, how,
                 info.device, info.cores, info.ram_gb, info.key or "none")
        return Registered(registered=info.id, reachable=True, ttl=self.settings.ttl)

    def _make_room_for(self, info: ProviderInfo, source: str) -> None:
        """Bound registrations per key and per address (``Registrants``): a new provider over a
        bound evicts that key's or address's oldest silent one, or is refused."""
        silent_before = self.clock.time() - self.settings.ttl / 2
        for gone in self.registrants.make_room(info.id, info.key, source, self.registry.providers(), silent_before):
            self.registry.remove(gone)
            self.relay.release_holder(Holder("provider", gone))
            log.info("provider %s dropped: silent, and a new provider of its key or address needed its place", gone)

    def _heartbeat(self, message: Heartbeat, req: Envelope) -> HeartbeatAnswer:
        self._same_key(req, message.id)
        self.registrants.seen(message.id, req.peer_address)
        known = self.registry.heartbeat(message.id, message.status, message.task, message.last_task)
        return HeartbeatAnswer(known=known, ttl=self.settings.ttl, revoked=self.registry.revoked())

    def _leave(self, message: ProviderId, req: Envelope) -> Left:
        self._same_key(req, message.id)
        left = self.registry.remove(message.id)
        if left:
            log.info("provider %s left", message.id)
        return Left(left=left)

    def board(self) -> dict:
        """What the dashboard shows (plain JSON values): providers, the latest tasks with their
        progress, and the registry's history. Never a data shard, a model or a secret."""
        if not self.registry.is_open:
            return {"kind": "network", "title": "meshlearn network (starting)", "providers": [], "tasks": [],
                    "history": []}
        now = self.clock.time()
        providers = [{"id": p.id, "status": p.status, "task": p.task, "device": p.device, "cores": p.cores,
                      "ram_gb": p.ram_gb, "location": p.location, "reachable": bool(p.reachable),
                      "seen_s": max(0.0, now - p.last_seen), "key": _fingerprint(p.key), "key_full": p.key}
                     for p in sorted(self.registry.providers(), key=lambda p: p.id)]
        history = self.registry.history(200)
        released = {}  # task id -> its (latest) release, where the history still holds it
        for event in reversed(history):
            if event["kind"] == "released":
                released[event["subject"]] = {"at": event["at"], "detail": event["detail"]}
        tasks = []
        for record in self.registry.tasks(50):
            live = self.tasks.page_view(record)
            tasks.append({"id": record["id"], "requester": record["requester"], "status": record["status"],
                          "created": record["created"], "providers": [p["id"] for p in record["providers"]],
                          "released": released.get(record["id"]), **live})
        return {"kind": "network", "title": f"meshlearn network · bootstrap {self.server.address}",
                "providers": providers, "tasks": tasks, "history": history}


def _fingerprint(key: str) -> str:
    """A provider's key as the page shows it (its fingerprint; empty without a key)."""
    try:
        return fingerprint(key_from_text(key)) if key else ""
    except UserInputError:
        return ""

