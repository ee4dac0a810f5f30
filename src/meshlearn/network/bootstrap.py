"""The bootstrap node: entry point of the network and registry of providers (``meshlearn bootstrap``)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from pydantic import Field

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import BadMessage, UserInputError
from meshlearn.network.addresses import is_wildcard
from meshlearn.network.envelope import Envelope, field_of
from meshlearn.network.registry import DEVICE_ORDER, ProviderInfo, Registry
from meshlearn.network.rpc import RpcServer
from meshlearn.settings import Settings

log = logging.getLogger(__name__)
SWEEP_EVERY = 1.0  # seconds between sweeps for providers whose heartbeat stopped


class BootstrapSettings(Settings):
    """Where the bootstrap listens, where it keeps its registry, and how long a heartbeat lasts."""

    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all)")
    port: int = Field(8080, ge=0, le=65535, description="port to listen on")
    state: str = Field("meshlearn-bootstrap.sqlite", description="SQLite file of the registry")
    ttl: float = Field(30.0, gt=0, description="seconds without a heartbeat before a provider is dropped")
    max_message_bytes: int = Field(1024 * 1024, gt=0, description="largest request accepted")


class Bootstrap:
    """Serves registration, heartbeats, discovery and atomic claims; expires silent providers."""

    def __init__(self, settings: BootstrapSettings, secret: bytes, clock: Clock = SYSTEM):
        self.settings = settings
        self.clock = clock
        self.registry = Registry(settings.state, clock)
        self.server = RpcServer("bootstrap", settings.host, settings.port, secret, {
            "ping": lambda req: {"service": "bootstrap"},
            "register": self._register,
            "heartbeat": self._heartbeat,
            "leave": self._leave,
            "discover": self._discover,
            "claim": self._claim,
            "release": self._release,
            "task": self._task,
        }, max_bytes=settings.max_message_bytes)
        self._stop = threading.Event()

    def run(self, ready: threading.Event | None = None) -> None:
        """Serve until ``stop()``: bind, open the registry, sweep expired providers every second.
        Binding comes first, so a port in use leaves nothing behind (no new state file)."""
        self.server.bind()
        try:
            self._open_registry()
        except BaseException:
            self.server.stop()
            raise
        try:
            self.server.start()
            log.info("bootstrap listening on %s (registry %s, %d provider(s) restored)",
                     self.server.address, self.settings.state, len(self.registry.providers()))
            if ready is not None:
                ready.set()
            while not self.clock.wait(self._stop, SWEEP_EVERY):
                self.server.check()
                for gone in self.registry.expire(self.settings.ttl):
                    log.info("provider %s expired (no heartbeat for %g s)", gone, self.settings.ttl)
        finally:
            self.server.stop()
            self.registry.close()

    def _open_registry(self) -> None:
        if self.settings.state != ":memory:":
            folder = Path(self.settings.state).parent
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise UserInputError(f"--state {self.settings.state}: cannot make its folder {folder} "
                                     f"({exc.strerror}): give a path in a folder you can write") from None
        self.registry.open()

    def stop(self) -> None:
        self._stop.set()

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
        host, sep, port = info.address.rpartition(":")
        if not sep or is_wildcard(host) or not port.isdigit():
            raise BadMessage(f"address {info.address!r} is not one peers can connect to: start the provider "
                             "with --advertise HOST (the address other machines reach it at)")
        self.registry.register(info)
        log.info("provider %s registered at %s (%s, %d cores, %.1f GB)", info.id, info.address,
                 info.device, info.cores, info.ram_gb)
        return {"registered": info.id, "ttl": self.settings.ttl}

    def _heartbeat(self, req: Envelope) -> dict:
        b = req.body
        known = self.registry.heartbeat(field_of(b, "id", str, max_len=64), _status(field_of(b, "status", str)),
                                        field_of(b, "task", (str, type(None)), None, max_len=64),
                                        field_of(b, "last_task", (str, type(None)), None, max_len=64))
        return {"known": known, "ttl": self.settings.ttl}

    def _leave(self, req: Envelope) -> dict:
        return {"left": self.registry.remove(field_of(req.body, "id", str, max_len=64))}

    def _discover(self, req: Envelope) -> dict:
        b = req.body
        found = self.registry.discover(
            field_of(b, "count", int, 100, min_value=1), field_of(b, "device", str, "any"),
            field_of(b, "location", (str, type(None)), None), field_of(b, "free_only", bool, True))
        return {"providers": [p.public() for p in found]}

    def _claim(self, req: Envelope) -> dict:
        b = req.body
        task_id = field_of(b, "task", str, max_len=64)
        taken = self.registry.claim(task_id, req.sender[:128], field_of(b, "count", int, min_value=1),
                                    field_of(b, "device", str, "any"), field_of(b, "location", (str, type(None)), None))
        if not taken:
            raise BadMessage("no free provider matches the request: wait for one or relax --device/--location")
        return {"providers": [p.public() for p in taken]}

    def _release(self, req: Envelope) -> dict:
        lost = field_of(req.body, "lost", list, [], max_len=256)
        if not all(isinstance(p, str) and len(p) <= 64 for p in lost):
            raise BadMessage("lost must list provider ids")
        self.registry.release(field_of(req.body, "task", str, max_len=64),
                              field_of(req.body, "status", str, "done", max_len=32), lost)
        return {"released": True}

    def _task(self, req: Envelope) -> dict:
        record = self.registry.task(field_of(req.body, "task", str, max_len=64))
        if record is None:
            raise BadMessage(f"task {req.body.get('task')!r} is unknown to this bootstrap")
        return record


def _status(value: str) -> str:
    if value not in ("free", "busy", "leaving"):
        raise BadMessage(f"status {value!r} is not free, busy or leaving")
    return value

