"""The bootstrap node: entry point of the network and registry of providers (``meshlearn bootstrap``)."""

from __future__ import annotations

import logging
import socket
import threading
from pathlib import Path

from pydantic import Field

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage, NetworkError, UserInputError
from meshlearn.network.bootstrap.registrants import Registrants
from meshlearn.network.bootstrap.registry import ProviderInfo, Registry
from meshlearn.network.bootstrap.taskboard import TaskBoard
from meshlearn.network.channel.addresses import is_wildcard, reachable_hosts
from meshlearn.network.channel.envelope import Envelope, field_of
from meshlearn.network.channel.filelimit import raise_open_file_limit
from meshlearn.network.channel.identity import (
    KeyPair,
    fingerprint,
    key_from_text,
    key_in,
    key_text,
    pinned,
)
from meshlearn.network.channel.relay import Holder, Relay
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.protocol.rpcs import Server, dispatch
from meshlearn.network.task.resources import DEVICE_ORDER
from meshlearn.network.task.spec import MAX_TASK_PEERS
from meshlearn.settings import Settings
from meshlearn.sparselog import SparseLog

log = logging.getLogger(__name__)
SWEEP_EVERY = 1.0  # seconds between sweeps for providers whose heartbeat stopped
MAX_CANDIDATES = 1024  # provider ids a claim may list in its preferred order
MAX_REGISTERING = 4096  # (key, provider id) pairs remembered as registering through the relay, the oldest forgotten first
PROBE_TIMEOUT = 3.0  # seconds the bootstrap waits when it dials a participant back


class BootstrapSettings(Settings):
    """Where the bootstrap listens, where it keeps its registry, and how long a heartbeat lasts."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all)")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on")
    state: str = Field("meshlearn-bootstrap.sqlite", description="SQLite file of the registry")
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
    """Serves registration, heartbeats, discovery and atomic claims; expires silent providers."""

    def __init__(self, settings: BootstrapSettings, secret: bytes, keys: KeyPair | None = None,
                 clock: Clock = SYSTEM):
        self.settings = settings
        self.secret = secret
        self.keys = keys  # None: plain ZeroMQ, for tests on loopback only
        self.clock = clock
        self.registry = Registry(settings.state, clock)
        self.tasks = TaskBoard(clock)
        self.server = RpcServer("bootstrap", settings.host, settings.port, secret, dispatch(Server.BOOTSTRAP, {
            "ping": lambda req: {"service": "bootstrap"},
            "register": self._register,
            "heartbeat": self._heartbeat,
            "leave": self._leave,
            "discover": self._discover,
            "claim": self._claim,
            "claim.replace": self._claim_replace,
            "release": self._release,
            "task": self._task,
            "probe": self._probe,
            "relay.open": self._relay_open,
            "relay.close": self._relay_close,
            "task.progress": self._task_progress,
        }), max_bytes=settings.max_request_bytes, keys=keys, admit=self._admit)
        public_host = settings.public_host()
        relay_port = (settings.port + 1 if settings.port else 0) if settings.relay_port is None else settings.relay_port
        self.relay = Relay(settings.host, relay_port, public_host, keys.text if keys else "",
                           settings.relay_port_range())
        self.registrants = Registrants()
        self._registering: dict[tuple[str, str], bool] = {}  # (key, provider id) told to come back through the relay
        self._stop = threading.Event()
        self._warn = SparseLog(log)  # refused revoked keys, by key

    def run(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()``: bind, open the registry, sweep expired providers every second.
        Binding comes first, so a port in use leaves nothing behind (no new state file)."""
        raise_open_file_limit()
        self.server.bind()
        try:
            self.relay.bind()
            self._open_registry()
        except BaseException:
            self.server.stop()
            self.relay.stop()
            raise
        try:
            self.server.start()
            self.relay.start()
            log.info("bootstrap listening on %s, relay on %s (registry %s, %d provider(s) restored)",
                     self.server.address, self.relay.port, self.settings.state, len(self.registry.providers()))
            if ready is not None:
                ready.set()
            while not self.clock.wait(self._stop, SWEEP_EVERY):
                self.server.check()
                for gone in self.registry.expire(self.settings.ttl):
                    log.info("provider %s expired (no heartbeat for %g s)", gone, self.settings.ttl)
                self._release_ended_work()
        finally:
            self.server.stop()
            self.relay.stop()
            self.registry.close()

    @property
    def address(self) -> str:
        """``HOST:PORT@KEY`` that providers and requesters give as ``--bootstrap``."""
        return self.server.reached_at(self.relay.public_host)

    def _open_registry(self) -> None:
        if self.settings.state != ":memory:":
            folder = Path(self.settings.state).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserInputError(f"--state {self.settings.state}: cannot make its folder {folder} "
                                     f"({exc.strerror}): give a path in a folder you can write") from None
        self.registry.open()
        dropped = self.registry.drop_unverified(keys_required=self.keys is not None)
        if dropped:  # their relay allocations died with the last run, or they never proved a key
            log.info("%d provider(s) of the last run must register again: %s", len(dropped), ", ".join(dropped))

    def stop(self) -> None:
        self._stop.set()

    def _admit(self, key: bytes) -> bool:
        """ZAP's question for each new connection: is this key shut out? (Any other key may ask to
        register: the network secret it must sign with admits it.)"""
        if self.registry.is_revoked(key_text(key)):
            self._warn.warning(key_text(key), "refused a connection from revoked key %s", key_text(key))
            return False
        return True

    def _caller_key(self, req: Envelope) -> str:
        return key_text(req.peer_key) if req.peer_key is not None else ""

    def _same_key(self, req: Envelope, provider_id: str) -> None:
        """Only the key a provider registered with may speak for it (heartbeats, leaving)."""
        known = self.registry.key_of(provider_id)
        if known is not None and known != self._caller_key(req):
            log.warning("refused %s for provider %s from another key (%s)", req.kind, provider_id,
                        self._caller_key(req))
            raise BadMessage(f"provider {provider_id} is registered with another key")

    def _probe(self, req: Envelope) -> dict:
        """Can this bootstrap dial ``address`` back (the caller's, proving the caller's key)?"""
        address = field_of(req.body, "address", str, max_len=256)
        return {"reachable": self._reach(address, req) is not None, "relay": self.relay.address}

    def _reach(self, address: str, req: Envelope) -> str | None:
        """How peers reach ``address``, announced by the caller of ``req``: "direct" (dialed back,
        the caller's key answered), "relayed" (a live relay allocation of the caller's), or None.
        Only the caller's own IP address is dialed: the bootstrap never dials a third party."""
        host, sep, port = address.rpartition(":")
        if not sep or is_wildcard(host) or not port.isdigit():
            raise BadMessage(f"address {address!r} is not one peers can connect to: start it with --advertise HOST "
                             "(the address other machines reach it at)")
        owner = self.relay.owner_of(address)
        if owner is not None:
            return "relayed" if owner == self._caller_key(req) else None
        if not self.settings.dial_back:
            return "direct"
        if req.peer_address and not _is_host(host, req.peer_address):
            log.info("%s is not where the request came from (%s): not dialed", address, req.peer_address)
            return None
        try:
            call(pinned(address, req.peer_key), "ping", {}, self.secret, timeout=PROBE_TIMEOUT, sender="bootstrap",
                 keys=self.keys)
            return "direct"
        except NetworkError as exc:
            log.info("%s cannot be reached from here (%s)", address, exc)
            return None

    def _relay_open(self, req: Envelope) -> dict:
        """A relay allocation for the caller (behind NAT), for registered work only: the provider
        it registers (told to come back through the relay) or a running task it is part of. Its
        token and public address."""
        holder, settled = self._relay_holder(req)
        token, address = self.relay.allocate(self._caller_key(req), req.peer_address, holder, settled)
        log.info("relay: port %s allocated to key %s for %s", address.rpartition(":")[2], self._caller_key(req),
                 holder)
        return {"token": token, "address": address, "relay": self.relay.address}

    def _relay_holder(self, req: Envelope) -> tuple[Holder, bool]:
        """What an allocation asked for in ``req`` serves, and whether that work is registered
        already; refused (BadMessage) unless the caller registers that provider or is part of that task."""
        caller = self._caller_key(req)
        if "task" in req.body:
            task_id = field_of(req.body, "task", str, max_len=64)
            record = self.registry.task(task_id)
            if record is None or record["status"] != "running" or (
                    caller != record["requester_key"] and caller not in {key_in(p["address"]) for p in record["providers"]}):
                raise BadMessage(f"task {task_id!r} is not a running task this key requested or was claimed for: "
                                 "the relay serves registered work only")
            return Holder("task", task_id), True
        if "provider" not in req.body:
            raise BadMessage("relay.open names the provider this key registers or a task it is part of: the relay "
                             "serves registered work only")
        provider_id = field_of(req.body, "provider", str, max_len=64)
        known = self.registry.key_of(provider_id)
        if known is None and (caller, provider_id) not in self._registering:
            raise BadMessage(f"provider {provider_id!r} is not registering with this key: register first (the relay "
                             "serves registered providers and claimed tasks only)")
        if known is not None and known != caller:
            raise BadMessage(f"provider {provider_id} is registered with another key")
        return Holder("provider", provider_id), known is not None

    def _release_ended_work(self) -> None:
        """Close the relay allocations of providers no longer registered and of tasks no longer running."""
        for holder in self.relay.holders(settled=True):
            if holder.kind == "provider":
                ended = self.registry.key_of(holder.name) is None
            else:
                record = self.registry.task(holder.name)
                ended = record is None or record["status"] != "running"
            if ended and self.relay.release_holder(holder):
                log.info("relay: allocations of %s closed (its work ended)", holder)

    def _relay_close(self, req: Envelope) -> dict:
        """The caller gives back one of its allocations (a task's engine that ended)."""
        return {"closed": self.relay.release(field_of(req.body, "token", str, max_len=64), self._caller_key(req))}

    def _register(self, req: Envelope) -> dict:
        b = req.body
        device = field_of(b, "device", str)
        if device not in DEVICE_ORDER:
            raise BadMessage(f"device {device!r} is not one of {sorted(DEVICE_ORDER)}")
        info = ProviderInfo(
            id=field_of(b, "id", str, max_len=64), address=field_of(b, "address", str, max_len=256),
            ram_gb=float(field_of(b, "ram_gb", (int, float), min_value=0)),
            cores=field_of(b, "cores", int, min_value=1), device=device,
            location=field_of(b, "location", str, "", max_len=64),
            status=_status(field_of(b, "status", str, "free")), task=field_of(b, "task", (str, type(None)), None))
        self._same_key(req, info.id)
        info.key = self._caller_key(req)
        reach = self._reach(info.address, req)
        if reach == "relayed" and not self.relay.settle(info.address, info.key, Holder("provider", info.id)):
            reach = None  # an allocation opened for other work: this provider needs its own
        if reach is None:  # not recorded: it comes back with a relay allocation
            self._registering_through_relay(info.key, info.id)
            return {"registered": None, "reachable": False, "relay": self.relay.address, "ttl": self.settings.ttl}
        self._make_room_for(info, req.peer_address)
        info.reachable = reach == "direct"
        self.registry.register(info)
        self._registering.pop((info.key, info.id), None)
        how = "reachable" if info.reachable else "through the relay"
        log.info("provider %s registered at %s, %s (%s, %d cores, %.1f GB, key %s)", info.id, info.address, how,
                 info.device, info.cores, info.ram_gb, info.key or "none")
        return {"registered": info.id, "reachable": True, "ttl": self.settings.ttl}

    def _registering_through_relay(self, key: str, provider_id: str) -> None:
        """Remember that ``key`` was told to register ``provider_id`` through the relay (what
        entitles it to one allocation), forgetting the oldest beyond MAX_REGISTERING."""
        self._registering.pop((key, provider_id), None)
        self._registering[(key, provider_id)] = True
        while len(self._registering) > MAX_REGISTERING:
            del self._registering[next(iter(self._registering))]

    def _make_room_for(self, info: ProviderInfo, source: str) -> None:
        """Bound registrations per key and per address (``Registrants``): a new provider over a
        bound evicts that key's or address's oldest silent one, or is refused."""
        silent_before = self.clock.time() - self.settings.ttl / 2
        for gone in self.registrants.make_room(info.id, info.key, source, self.registry.providers(), silent_before):
            self.registry.remove(gone)
            self.relay.release_holder(Holder("provider", gone))
            log.info("provider %s dropped: silent, and a new provider of its key or address needed its place", gone)

    def _heartbeat(self, req: Envelope) -> dict:
        b = req.body
        provider_id = field_of(b, "id", str, max_len=64)
        self._same_key(req, provider_id)
        self.registrants.seen(provider_id, req.peer_address)
        known = self.registry.heartbeat(provider_id, _status(field_of(b, "status", str)),
                                        field_of(b, "task", (str, type(None)), None, max_len=64),
                                        field_of(b, "last_task", (str, type(None)), None, max_len=64))
        return {"known": known, "ttl": self.settings.ttl, "revoked": self.registry.revoked()}

    def _leave(self, req: Envelope) -> dict:
        provider_id = field_of(req.body, "id", str, max_len=64)
        self._same_key(req, provider_id)
        left = self.registry.remove(provider_id)
        if left:
            log.info("provider %s left", provider_id)
        return {"left": left}

    def _discover(self, req: Envelope) -> dict:
        b = req.body
        found = self.registry.discover(
            field_of(b, "count", int, 100, min_value=1), field_of(b, "device", str, "any"),
            field_of(b, "location", (str, type(None)), None), field_of(b, "free_only", bool, True),
            **_fit_fields(b))
        return {"providers": [p.public() for p in found]}

    def _claim(self, req: Envelope) -> dict:
        b = req.body
        task_id = field_of(b, "task", str, max_len=64)
        order = field_of(b, "order", list, [], max_len=MAX_CANDIDATES)
        if not all(isinstance(p, str) and len(p) <= 64 for p in order):
            raise BadMessage("order must list provider ids")
        taken = self.registry.claim(task_id, req.sender[:128], field_of(b, "count", int, min_value=1),
                                    field_of(b, "device", str, "any"), field_of(b, "location", (str, type(None)), None),
                                    requester_key=self._caller_key(req), order=order, **_fit_fields(b))
        if not taken:
            raise BadMessage("no free provider matches the request: wait for one or relax --device, --location, "
                             "--min-ram or --min-cores")
        log.info("task %s claimed by %s (key %s): %s", task_id, req.sender[:128], self._caller_key(req),
                 ", ".join(p.id for p in taken))
        return {"providers": [p.public() for p in taken]}

    def _claim_replace(self, req: Envelope) -> dict:
        """The claiming requester drops providers that could not take its task (before it started)
        and claims others in their place, with the claim's own filters."""
        record = self._claimed_by_caller(req)
        b = req.body
        drop = field_of(b, "drop", list, max_len=MAX_TASK_PEERS)
        exclude = field_of(b, "exclude", list, [], max_len=4 * MAX_TASK_PEERS)
        count = field_of(b, "count", int, min_value=0)
        members = {p["id"] for p in record["providers"]}
        if not all(isinstance(p, str) and p in members for p in drop):
            raise BadMessage("drop must list providers of this task")
        if not all(isinstance(p, str) and len(p) <= 64 for p in exclude) or count > MAX_TASK_PEERS:
            raise BadMessage(f"exclude must list provider ids, count be at most {MAX_TASK_PEERS}")
        taken = self.registry.replace(record["id"], drop, count, field_of(b, "device", str, "any"),
                                      field_of(b, "location", (str, type(None)), None), exclude, **_fit_fields(b))
        log.info("task %s: %s dropped before the start; in their place: %s", record["id"], ", ".join(drop),
                 ", ".join(p.id for p in taken) or "none free")
        return {"providers": [p.public() for p in taken]}

    def _release(self, req: Envelope) -> dict:
        """The claiming requester ends its task: its providers are freed, those it lost set aside."""
        record = self._claimed_by_caller(req)
        lost = field_of(req.body, "lost", list, [], max_len=256)
        if not all(isinstance(p, str) and len(p) <= 64 for p in lost):
            raise BadMessage("lost must list provider ids")
        status = field_of(req.body, "status", str, "done", max_len=32)
        self.registry.release(record["id"], status, lost)
        log.info("task %s released (%s)%s", record["id"], status, f"; lost: {', '.join(lost)}" if lost else "")
        return {"released": True}

    def _task_progress(self, req: Envelope) -> dict:
        """A requester's report of its task (progress, faults, result), for the dashboard; the
        reply names the task's providers whose keys were revoked since (they are out of the task)."""
        record = self._claimed_by_caller(req)
        self.tasks.report(record["id"], req.body)
        return {"noted": True, "revoked": self._revoked_in(record)}

    def _claimed_by_caller(self, req: Envelope) -> dict:
        """The record of the task named in ``req``, if the caller's key claimed it (else refused)."""
        task_id = field_of(req.body, "task", str, max_len=64)
        record = self.registry.task(task_id)
        if record is None or record["requester_key"] != self._caller_key(req):
            raise BadMessage(f"task {task_id!r} is not one this key requested")
        return record

    def _revoked_in(self, record: dict) -> list[str]:
        """The ids of a task's providers whose keys are revoked."""
        return [p["id"] for p in record["providers"] if self.registry.is_revoked(key_in(p["address"]))]

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

    def _task(self, req: Envelope) -> dict:
        """A task's record, for its requester (``meshlearn results``) and its providers (who check
        an assignment against it): its providers, the key that claimed it, which were revoked and
        which left the network since it was claimed."""
        task_id = field_of(req.body, "task", str, max_len=64)
        record = self.registry.task(task_id)
        caller = self._caller_key(req)
        if record is None or (caller != record["requester_key"]
                              and caller not in {key_in(p["address"]) for p in record["providers"]}):
            raise BadMessage(f"task {task_id!r} is not one this key requested or was claimed for")
        left = self.registry.left_since([p["id"] for p in record["providers"]], record["created"])
        return {**record, "revoked": self._revoked_in(record), "left": left}


def _fingerprint(key: str) -> str:
    """A provider's key as the page shows it (its fingerprint; empty without a key)."""
    try:
        return fingerprint(key_from_text(key)) if key else ""
    except UserInputError:
        return ""


def _is_host(host: str, address: str) -> bool:
    """Whether ``host`` (an address or a name) is ``address``."""
    if host == address:
        return True
    try:
        return address in {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except OSError:
        return False


def _status(value: str) -> str:
    if value not in ("free", "busy", "leaving"):
        raise BadMessage(f"status {value!r} is not free, busy or leaving")
    return value


def _fit_fields(body: dict) -> dict:
    """The least RAM and cores a discover or claim asks of providers, and whether other devices may
    fill in (``registry.select``)."""
    return {"min_ram_gb": float(field_of(body, "min_ram_gb", (int, float), 0.0, min_value=0)),
            "min_cores": field_of(body, "min_cores", int, 0, min_value=0),
            "fallback": field_of(body, "fallback", bool, False)}
