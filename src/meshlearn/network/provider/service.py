"""A provider: lends this machine's compute to the network, one task at a time (``meshlearn provider``)."""

from __future__ import annotations

import logging
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import (
    AuthError,
    BadMessage,
    KeyMismatch,
    KeyRefused,
    NetworkError,
    ProtocolMismatch,
    UserInputError,
)
from meshlearn.network.channel.addresses import announced_host
from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import KeyPair, key_text, split_pinned, state_home
from meshlearn.network.channel.punch import PunchMemory
from meshlearn.network.channel.rpc import RpcServer
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import (
    Heartbeat,
    Named,
    ProviderId,
    Register,
)
from meshlearn.network.protocol.bootstraps import Bootstraps
from meshlearn.network.protocol.message import Empty, Message
from meshlearn.network.protocol.providerapi import Leaving
from meshlearn.network.protocol.rpcs import Server
from meshlearn.network.protocol.serving import relay_requests, serve
from meshlearn.network.provider.natside import NatSide, ipv4_of
from meshlearn.network.provider.relays import RelayAllocations
from meshlearn.network.provider.tasks import TaskDesk, proven_caller
from meshlearn.network.provider.testhooks import NO_HOOKS, TestHooks
from meshlearn.network.task.resources import machine_cores, machine_ram_gb
from meshlearn.plugins import load_user_module
from meshlearn.settings import MaxMessageMb, MessageLimit
from meshlearn.sparselog import SparseLog

if TYPE_CHECKING:
    from meshlearn.network.provider.taskrun import ProviderContext, TaskRun

log = logging.getLogger(__name__)

# Handlers never wait for other providers (held pushes live in the engine's hub, final models are
# recorded at once), so a small pool serves any task size.
HANDLER_THREADS = 16


class ProviderSettings(MessageLimit):
    """How a provider joins: its bootstrap, where it listens, what it declares, where it keeps tasks."""

    bootstrap: str = Field(description="HOST:PORT[@KEY] of the bootstrap; several, comma-separated, where the "
                           "network has several (any answers)")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all)")
    advertise: str = Field("", description="address requesters and other providers connect to (default: --host; "
                           "with 0.0.0.0, this machine's address on the route to the bootstrap)")
    port: int = Field(0, ge=0, le=65535, description="port to listen on (in use or 0: a free one)")
    location: str = Field("", max_length=64, description="where this machine is (requesters may filter on it)")
    ram_gb: float | None = Field(None, ge=0, description="GB of RAM to declare (default: detected)")
    cores: int | None = Field(None, ge=1, description="cores to declare, and torch's threads (intra- and "
                              "inter-op) a task trains with, shared by the task's providers on this machine "
                              "(default: detected)")
    device: str = Field("auto", description="auto | cpu | cuda | cuda:N | mps (falls back to cpu)")
    workdir: str = Field("", description="where tasks' data and results are kept (default provider-ID in "
                         "$MESHLEARN_HOME, else ~/.meshlearn)")
    data_root: str | None = Field(None, description="folder whose datasets tasks may name with --data-on-providers")
    keep_data: bool = Field(False, description="keep each task's data shard in --workdir once the task ended (its "
                            "result is always kept)")
    models_module: str | None = Field(None, description="local .py file registering custom models (never from "
                                                        "the network)")
    provider_id: str = Field("", description="provider id (default: host name and a random suffix)")
    max_message_mb: MaxMessageMb  # its server's requests and its tasks' engine messages
    key: str = Field("", description="file of this provider's key pair, made on first start (default: "
                     "provider.key in --workdir if given, else $MESHLEARN_HOME or ~/.meshlearn/provider.key)")

    def key_file(self) -> Path:
        if self.key:
            return Path(self.key).expanduser()
        return (Path(self.workdir) if self.workdir else state_home()) / "provider.key"


def limit_threads(cores: int | None) -> None:
    """Bound torch to the declared cores: its intra-op threads (a task narrows them further when
    several of its providers share this machine, ``TaskRun.threads``) and its inter-op threads,
    which can be set once per process only, before any parallel work: at the provider's start."""
    import torch

    if cores is None:
        return
    torch.set_num_threads(cores)
    try:
        torch.set_num_interop_threads(cores)
    except RuntimeError as exc:  # set already (a provider in a test's process): keep the first
        log.info("inter-op threads stay %d: %s", torch.get_num_interop_threads(), exc)


def detect_device(requested: str) -> tuple[str, str | None]:
    """The device to train on and a warning if the requested one does not work here."""
    import torch

    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda", None
        mps = getattr(torch.backends, "mps", None)
        return ("mps" if mps is not None and mps.is_available() else "cpu"), None
    if requested == "cpu":
        return "cpu", None
    try:
        torch.ones(1, device=requested).sum().item()
        return requested.split(":")[0], None
    except Exception as exc:  # noqa: BLE001 - any failure means: not usable here
        return "cpu", f"device {requested} does not work here ({str(exc).splitlines()[0]}): training on the CPU"


class Provider:
    """Registers with the bootstrap, heartbeats, runs assigned tasks and serves their results. The
    facade of the provider: its tasks and the requests about them are its ``TaskDesk``'s, its relay
    allocations behind NAT its ``RelayAllocations``'."""

    def __init__(self, settings: ProviderSettings, secret: bytes, keys: KeyPair | None = None, clock: Clock = SYSTEM,
                 hooks: TestHooks = NO_HOOKS):
        self.settings = settings
        self.secret = secret
        self.keys = keys  # None: plain ZeroMQ, for tests on loopback only
        self.bootstraps = Bootstraps.parse(settings.bootstrap)  # the one that answers is asked, the others after
        self.clock = clock
        self.hooks = hooks  # tests only (TestHooks.from_environment, read by meshlearn provider)
        self.id = settings.provider_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.workdir = Path(settings.workdir or state_home() / f"provider-{self.id}")
        self.leaving = threading.Event()
        self.desk = TaskDesk(self.id, keys, self.workdir, self.leaving, self._ask_bootstrap, self._task_context,
                             self._run_changed)
        self.allocations = RelayAllocations(settings.host, relay_requests(self._ask_bootstrap))
        self.punch_memory = PunchMemory(clock)  # peers a punch failed with lately: their links go to the relay
        self.server = RpcServer(f"provider {self.id}", settings.host, settings.port, secret, serve(Server.PROVIDER, {
            rpcs.PROVIDER_PING: lambda message, req: Named(service="provider", id=self.id),
            rpcs.TASK_ASSIGN: self.desk.assign,
            rpcs.TASK_START: self.desk.start,
            rpcs.TASK_JOIN: self.desk.join,
            rpcs.TASK_STATUS: self.desk.status,
            rpcs.TASK_RESULTS: self.desk.results,
            rpcs.TASK_CANCEL: self.desk.cancel,
            rpcs.AGG_PUSH: self.desk.push,
            rpcs.AGG_PING: self.desk.ping,
            rpcs.AGG_RESULTS: self.desk.take_results,
            rpcs.PROVIDER_LEAVE: self._leave_request,
        }), max_bytes=settings.max_message_bytes, workers=HANDLER_THREADS, keys=keys,
            admit=self._admit)
        self.revoked: frozenset[str] = frozenset()  # keys the bootstrap shut out (told with each heartbeat)
        self.device = "cpu"
        self.public_host = settings.advertise or settings.host  # settled in run(), once the bootstrap is known
        self._stop = threading.Event()
        self._warn = SparseLog(log)  # refused revoked keys, by key
        self._wake = threading.Event()  # cuts the heartbeat wait short (leave, stop)
        self._ttl = 30.0
        self._refused: ProtocolMismatch | None = None  # the bootstrap came back speaking another protocol
    # ---- life cycle ------------------------------------------------------------------------

    def run(self, ready: threading.Event | None = None) -> None:
        """Join, serve until asked to leave, finish the current task, then leave the network."""
        from meshlearn.network.provider import taskrun  # noqa: F401 - the task machinery loads now, not at the first task

        s = self.settings
        limit_threads(s.cores)
        if s.models_module:
            load_user_module(s.models_module)
        self.device, warning = detect_device(s.device)
        if warning:
            log.warning(warning)
        wanted = self.server.bind_any()
        if wanted:
            log.warning("port %d is in use: listening on %d instead", wanted, self.server.port)
        self.server.start()
        self.public_host = announced_host(s.host, s.advertise, split_pinned(self.bootstraps.current)[0])
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            registered = self._register()
        except BaseException:
            self.server.stop()
            raise
        if not registered:  # stopped (Ctrl-C, SIGTERM) before the bootstrap ever answered
            self.server.stop()
            print(f"provider {self.id}: stopped before it could register with {s.bootstrap}", flush=True)
            return
        listening = self.server.address + (f", reached at {self.address}" if self.address != self.server.address else "")
        print(f"provider {self.id} listening on {listening} ({self.declared_device}); "
              f"registered with {s.bootstrap}", flush=True)
        if ready is not None:
            ready.set()
        try:
            while not self._stop.is_set():
                self.server.check()
                self._heartbeat()
                if self.leaving.is_set() and not self.desk.busy():
                    break
                self.clock.wait(self._wake, 1.0 if self.leaving.is_set() else self._ttl / 3)
                self._wake.clear()
        finally:
            stopping = self._stop.is_set()
            if stopping and self.desk.busy():
                self.desk.current.cancel()
            self._say_goodbye(attempts=1 if stopping else 3)
            self.server.stop()
            self.allocations.stop()
        if self._refused is not None:  # one line for the user, after a clean stop
            raise self._refused

    def leave(self) -> None:
        """Leave after the current task (Ctrl-C, ``meshlearn leave``): no new task is accepted."""
        if not self.leaving.is_set():
            self.leaving.set()
            task = self.desk.busy_with()
            print(f"provider {self.id}: leaving" + (f" after task {task} finishes" if task else ""), flush=True)
            self._wake.set()

    def stop(self) -> None:
        """Stop now (SIGTERM, a second Ctrl-C): the current task is cancelled, the provider leaves."""
        self._stop.set()
        self._wake.set()

    @property
    def relayed(self) -> bool:
        """Whether peers reach this provider through the bootstrap's relay (it cannot be dialed)."""
        return self.allocations.front is not None

    @property
    def address(self) -> str:
        """HOST:PORT that peers connect to (announced to the bootstrap): this machine's, or the relay's."""
        front = self.allocations.front
        return front.address if front is not None else f"{self.public_host}:{self.server.port}"

    def _admit(self, key: bytes) -> bool:
        if key_text(key) in self.revoked:
            self._warn.warning(key_text(key), "refused a connection from revoked key %s", key_text(key))
            return False
        return True

    def expose(self, port: int, task_id: str) -> tuple[str, Callable[[], None]]:
        """HOST:PORT where peers reach this machine's ``port`` (the engine of task ``task_id``), and
        what closes it: this machine's own address, or, behind NAT, a new allocation of the
        bootstrap's relay for that task."""
        if not self.relayed:
            return f"{self.public_host}:{port}", lambda: None
        allocation = self.allocations.allocate(port, Holder("task", task_id))
        return allocation.address, allocation.close

    def _run_changed(self, run: TaskRun) -> None:
        """A task run changed state: tell the bootstrap now (a provider is free the moment its part ends)."""
        self._wake.set()

    def _info(self) -> Register:
        """What this provider registers: where it answers, what it has, what it does."""
        s = self.settings
        return Register(id=self.id, address=self.address, ram_gb=float(round(s.ram_gb or machine_ram_gb(), 2)),
                        cores=s.cores or machine_cores(), device=self.declared_device, location=s.location,
                        **self._doing())

    @property
    def declared_device(self) -> str:
        """The device this provider declares: the one it trains on (a test may declare another)."""
        return self.hooks.declared_device or self.device

    def _doing(self) -> dict:
        current = self.desk.current
        status = "leaving" if self.leaving.is_set() else ("busy" if self.desk.busy() else "free")
        return {"status": status, "task": self.desk.busy_with(),
                "last_task": current.spec.task_id if current is not None else None}

    def _task_context(self) -> ProviderContext:
        """What a task run here may use of this provider (its limits among it: its message cap as
        given, ``max_message_mb``)."""
        from meshlearn.network.provider.taskrun import (
            ProviderContext,  # loads torch: not before a first task
        )

        return ProviderContext(self.id, self.settings.host, self.secret, self.workdir, self.device,
                               Path(self.settings.data_root) if self.settings.data_root else None,
                               self.settings.max_message_mb, self.clock, self.public_host,
                               self.expose, hooks=self.hooks, keep_data=self.settings.keep_data,
                               cores=self.settings.cores, relayed=self.relayed, nat=self._nat_side(),
                               punch_memory=self.punch_memory)

    def _nat_side(self) -> NatSide | None:
        """Where this provider, behind NAT, asks what its NAT maps: the reflector of the bootstrap whose
        relay serves it, at the relay's port and that bootstrap's own; None where it can be dialed."""
        front = self.allocations.front
        if front is None:
            return None
        host, relay_port = front.agent.relay
        bootstrap_port = relay_port  # a bootstrap this provider does not list by that host: one port, no second view
        for address in self.bootstraps.addresses:
            listed, _, port = address.partition("@")[0].rpartition(":")
            if port.isdigit() and ipv4_of(listed) == ipv4_of(host):
                bootstrap_port = int(port)
                break
        return NatSide(host, relay_port, bootstrap_port)

    # ---- the bootstrap -----------------------------------------------------------------------

    def _ask_bootstrap(self, rpc: rpcs.Rpc, message: Message, timeout: float) -> Message:
        """One typed call to the bootstrap, proving this provider's key (the one it registered with)."""
        return self.bootstraps.ask(rpc, message, self.secret, timeout=timeout, sender=self.id, keys=self.keys)

    def _register(self) -> bool:
        """Register (again); False if the provider was told to stop or leave before it could.
        A bootstrap that answers with another network secret, or speaks another protocol version, is
        a user error, not worth retrying."""
        attempt = 0
        while not (self._stop.is_set() or self.leaving.is_set()):
            attempt += 1
            try:
                reply = self._ask_bootstrap(rpcs.REGISTER, self._info(), timeout=6)  # a dial-back takes up to 3 s
                if not reply.reachable:  # not dialable, or its relay allocation is gone
                    front = self.allocations.replace_front(self.server.port, Holder("provider", self.id),
                                                           on_lost=self._wake.set)  # register again at once
                    print(f"provider {self.id}: the bootstrap cannot reach {self.public_host}:{self.server.port} "
                          f"(NAT or a firewall): peers reach it through the relay at {front.address}", flush=True)
                    continue
                if not reply.registered:
                    raise NetworkError(f"the bootstrap did not register {self.id}")
                self._ttl = reply.ttl
                return True
            except ProtocolMismatch:
                raise
            except (KeyMismatch, KeyRefused) as exc:
                raise UserInputError(f"cannot register with the bootstrap: {exc}") from None
            except AuthError:
                raise UserInputError(f"cannot register with {self.settings.bootstrap}: it uses a different secret; "
                                     "give this provider the network's --secret, --secret-file or MESHLEARN_SECRET"
                                     ) from None
            except NetworkError as exc:
                if attempt == 1:
                    log.warning("cannot register with %s yet (%s); retrying", self.settings.bootstrap, exc)
                self.clock.wait(self._wake, min(5.0, 0.5 * attempt))  # Ctrl-C or SIGTERM wakes it
                self._wake.clear()
        return False

    def _heartbeat(self) -> None:
        front_lost = self.allocations.front_lost  # the relay forgot it: restarted
        try:
            reply = self._ask_bootstrap(rpcs.HEARTBEAT, Heartbeat(id=self.id, **self._doing()), timeout=5)
            if not reply.known or front_lost:
                self._register()
            self.revoked = frozenset(reply.revoked)
            self._shut_out_revoked()
        except ProtocolMismatch as exc:  # a bootstrap of another release took its place: stop, then say so
            self._refused = exc
            self.stop()
        except KeyRefused:  # this provider's own key was revoked: it has no part in the network any more
            print(f"provider {self.id}: the bootstrap refuses this provider's key (revoked): stopping", flush=True)
            self.stop()
        except NetworkError as exc:  # a bootstrap restart must not disturb running tasks
            log.warning("heartbeat to %s failed: %s", self.settings.bootstrap, exc)

    def _shut_out_revoked(self) -> None:
        """The current task goes on without its providers whose keys were revoked (the requester's
        revoked: the task is cancelled)."""
        run = self.desk.current
        if run is None or not run.state.active or not self.revoked:
            return
        if run.access.requester in self.revoked:
            log.warning("task %s: its requester's key was revoked: cancelling it", run.spec.task_id)
            run.cancel(wait=0)
            return
        for index, key in enumerate(run.access.providers):
            if key in self.revoked and index != run.index:
                run.exclude(index, "its key was revoked")

    def _say_goodbye(self, attempts: int) -> None:
        for attempt in range(1, attempts + 1):
            try:
                self._ask_bootstrap(rpcs.LEAVE, ProviderId(id=self.id), timeout=5 if attempts > 1 else 2)
                print(f"provider {self.id} left the network (confirmed by {self.settings.bootstrap})", flush=True)
                return
            except ProtocolMismatch:  # it cannot hear this provider: it forgets it after its TTL
                break
            except NetworkError as exc:
                log.warning("leave attempt %d failed: %s", attempt, exc)
                if attempt < attempts:
                    self.clock.sleep(0.5 * attempt)
        print(f"provider {self.id}: the bootstrap did not confirm; it forgets this provider after its TTL", flush=True)

    def _leave_request(self, message: Empty, req: Envelope) -> Leaving:
        """``meshlearn leave``: only this provider's own key may make it leave."""
        if (caller := proven_caller(req, self.keys)) is not None and caller != self.keys.text:
            raise BadMessage(f"provider.leave refused: only provider {self.id}'s own key may make it leave (run "
                             "meshlearn leave where it runs, with its --workdir or --key)")
        self.leave()
        return Leaving(leaving=True, after_task=self.desk.busy_with())
