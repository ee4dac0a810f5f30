"""A provider: lends this machine's compute to the network, one task at a time (``meshlearn provider``)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field

from meshlearn.attacks.spec import parse_byzantine
from meshlearn.clock import SYSTEM, Clock
from meshlearn.errors import (
    AuthError,
    BadMessage,
    KeyMismatch,
    KeyRefused,
    NetworkError,
    UserInputError,
)
from meshlearn.netem import NetemSpec
from meshlearn.network.channel.addresses import announced_host
from meshlearn.network.channel.envelope import Envelope, field_of
from meshlearn.network.channel.identity import KeyPair, key_text, peer_key, state_home
from meshlearn.network.channel.relay import Allocation, Holder, hold_allocation
from meshlearn.network.channel.rpc import RpcServer, call
from meshlearn.network.protocol.rpcs import Server, dispatch
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.resources import machine_cores, machine_ram_gb
from meshlearn.network.task.results import read_results
from meshlearn.network.task.spec import TaskSpec
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

    bootstrap: str = Field(description="HOST:PORT of the bootstrap")
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 for all)")
    advertise: str = Field("", description="address requesters and other providers connect to (default: --host; "
                           "with 0.0.0.0, this machine's address on the route to the bootstrap)")
    port: int = Field(0, ge=0, le=65535, description="port to listen on (in use or 0: a free one)")
    location: str = Field("", description="where this machine is (requesters may filter on it)")
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


def test_poison() -> str:
    """The bad behaviour a provider started with ``MESHLEARN_TEST_POISON`` (a ``byzantine``
    behaviour, e.g. ``sign-flip:10``) gives every model it sends: for tests of robust aggregation
    only, never set in use. A bad value stops the task with a clear error."""
    poison = os.environ.get("MESHLEARN_TEST_POISON", "").strip()
    if poison:
        parse_byzantine(f"0:{poison}")
    return poison


def test_net() -> NetemSpec | None:
    """The emulated network a provider started with ``MESHLEARN_TEST_NET`` (``--net``'s syntax, e.g.
    ``loss=20%,delay=200ms,jitter=50ms``) puts on its task engines' links: for tests and benchmarks
    of slow, lossy links between providers on one machine only, never set in use. A bad value fails
    the provider's task with a clear error."""
    net = os.environ.get("MESHLEARN_TEST_NET", "").strip()
    return NetemSpec.parse(net) if net else None


def test_device() -> str:
    """The device a provider started with ``MESHLEARN_TEST_DEVICE`` (cpu, cuda or mps) declares to
    the bootstrap, whatever it trains on: for tests of device selection only, never set in use."""
    device = os.environ.get("MESHLEARN_TEST_DEVICE", "").strip()
    if device and device not in ("cpu", "cuda", "mps"):
        raise UserInputError(f"MESHLEARN_TEST_DEVICE {device!r} is not cpu, cuda or mps")
    return device


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
    """Registers with the bootstrap, heartbeats, runs assigned tasks and serves their results."""

    def __init__(self, settings: ProviderSettings, secret: bytes, keys: KeyPair | None = None, clock: Clock = SYSTEM):
        self.settings = settings
        self.secret = secret
        self.keys = keys  # None: plain ZeroMQ, for tests on loopback only
        self.clock = clock
        self.id = settings.provider_id or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}"
        self.workdir = Path(settings.workdir or state_home() / f"provider-{self.id}")
        self.server = RpcServer(f"provider {self.id}", settings.host, settings.port, secret, dispatch(Server.PROVIDER, {
            "ping": lambda req: {"service": "provider", "id": self.id},
            "task.assign": self._assign,
            "task.start": self._start_task,
            "task.join": self._join_task,
            "task.status": lambda req: {**self._requesters_run(req).status(), "leaving": self.leaving.is_set()},
            "task.results": self._results,
            "task.cancel": lambda req: (self._requesters_run(req).cancel(), {"cancelled": True})[1],
            "agg.push": lambda req: self._providers_run(req).on_push(req),
            "agg.ping": lambda req: self._providers_run(req).on_ping(req),
            "agg.results": lambda req: self._providers_run(req).on_results(req),
            "provider.leave": self._leave_request,
        }), max_bytes=settings.max_message_bytes, workers=HANDLER_THREADS, keys=keys,
            admit=self._admit)
        self.revoked: frozenset[str] = frozenset()  # keys the bootstrap shut out (told with each heartbeat)
        self._front: Allocation | None = None  # its server's relay allocation, if it has one
        self._allocations: list[Allocation] = []  # every one it holds: the server's and tasks' engines
        self.runs: dict[str, TaskRun] = {}
        self.current: TaskRun | None = None
        self.device = "cpu"
        self.public_host = settings.advertise or settings.host  # settled in run(), once the bootstrap is known
        self.leaving = threading.Event()
        self._stop = threading.Event()
        self._warn = SparseLog(log)  # refused revoked keys, by key
        self._wake = threading.Event()  # cuts the heartbeat wait short (leave, stop)
        self._ttl = 30.0
        self._lock = threading.Lock()

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
        self.public_host = announced_host(s.host, s.advertise, s.bootstrap)
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
                if self.leaving.is_set() and not self._busy():
                    break
                self.clock.wait(self._wake, 1.0 if self.leaving.is_set() else self._ttl / 3)
                self._wake.clear()
        finally:
            stopping = self._stop.is_set()
            if stopping and self._busy():
                self.current.cancel()
            self._say_goodbye(attempts=1 if stopping else 3)
            self.server.stop()
            for allocation in list(self._allocations):
                allocation.agent.stop()

    def leave(self) -> None:
        """Leave after the current task (Ctrl-C, ``meshlearn leave``): no new task is accepted."""
        if not self.leaving.is_set():
            self.leaving.set()
            task = self.current.spec.task_id if self._busy() else None
            print(f"provider {self.id}: leaving" + (f" after task {task} finishes" if task else ""), flush=True)
            self._wake.set()

    def stop(self) -> None:
        """Stop now (SIGTERM, a second Ctrl-C): the current task is cancelled, the provider leaves."""
        self._stop.set()
        self._wake.set()

    @property
    def relayed(self) -> bool:
        """Whether peers reach this provider through the bootstrap's relay (it cannot be dialed)."""
        return self._front is not None

    @property
    def address(self) -> str:
        """HOST:PORT that peers connect to (announced to the bootstrap): this machine's, or the relay's."""
        return self._front.address if self._front is not None else f"{self.public_host}:{self.server.port}"

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
        allocation = self._allocate(port, Holder("task", task_id))
        return allocation.address, allocation.close

    def _allocate(self, port: int, holder: Holder) -> Allocation:
        """A relay allocation for this machine's ``port`` serving ``holder``, served by an agent
        (given back by close)."""
        allocation = hold_allocation(lambda kind, body: self._ask_bootstrap(kind, body, timeout=10).body,
                                     self.settings.host, port, holder)
        self._allocations.append(allocation)
        close = allocation.close

        def release() -> None:
            close()
            if allocation in self._allocations:
                self._allocations.remove(allocation)
        allocation.close = release
        return allocation

    def _drop_front(self) -> None:
        if self._front is not None:
            self._front.close()
            self._front = None

    def _busy(self) -> bool:
        return self.current is not None and self.current.state.active

    def _run_changed(self, run: TaskRun) -> None:
        """A task run changed state: tell the bootstrap now (a provider is free the moment its part ends)."""
        self._wake.set()

    def _info(self) -> dict:
        s = self.settings
        return {"id": self.id, "address": self.address, "ram_gb": round(s.ram_gb or machine_ram_gb(), 2),
                "cores": s.cores or machine_cores(), "device": self.declared_device, "location": s.location,
                **self._doing()}

    @property
    def declared_device(self) -> str:
        """The device this provider declares: the one it trains on (a test may declare another)."""
        return test_device() or self.device

    def _doing(self) -> dict:
        status = "leaving" if self.leaving.is_set() else ("busy" if self._busy() else "free")
        return {"status": status, "task": self.current.spec.task_id if self._busy() else None,
                "last_task": self.current.spec.task_id if self.current is not None else None}

    def _ask_bootstrap(self, kind: str, body: dict, timeout: float) -> Envelope:
        """One call to the bootstrap, proving this provider's key (the one it registered with)."""
        return call(self.settings.bootstrap, kind, body, self.secret, timeout=timeout, sender=self.id, keys=self.keys)

    def _register(self) -> bool:
        """Register (again); False if the provider was told to stop or leave before it could.
        A bootstrap that answers with another network secret is a user error, not worth retrying."""
        attempt = 0
        while not (self._stop.is_set() or self.leaving.is_set()):
            attempt += 1
            try:
                reply = self._ask_bootstrap("register", self._info(), timeout=6)  # a dial-back takes up to 3 s
                if reply.body.get("reachable") is False:  # not dialable, or its relay allocation is gone
                    self._drop_front()
                    self._front = self._allocate(self.server.port, Holder("provider", self.id))
                    print(f"provider {self.id}: the bootstrap cannot reach {self.public_host}:{self.server.port} "
                          f"(NAT or a firewall): peers reach it through the relay at {self._front.address}", flush=True)
                    continue
                if not reply.body.get("registered"):
                    raise NetworkError(f"the bootstrap did not register {self.id}")
                self._ttl = float(reply.body.get("ttl", 30.0))
                return True
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
        front_lost = self._front is not None and self._front.agent.lost.is_set()  # the relay forgot it: restarted
        try:
            reply = self._ask_bootstrap("heartbeat", {"id": self.id, **self._doing()}, timeout=5)
            if not reply.body.get("known", True) or front_lost:
                self._register()
            revoked = reply.body.get("revoked", [])
            if isinstance(revoked, list) and all(isinstance(k, str) for k in revoked):
                self.revoked = frozenset(revoked)
                self._shut_out_revoked()
        except KeyRefused:  # this provider's own key was revoked: it has no part in the network any more
            print(f"provider {self.id}: the bootstrap refuses this provider's key (revoked): stopping", flush=True)
            self.stop()
        except NetworkError as exc:  # a bootstrap restart must not disturb running tasks
            log.warning("heartbeat to %s failed: %s", self.settings.bootstrap, exc)

    def _shut_out_revoked(self) -> None:
        """The current task goes on without its providers whose keys were revoked (the requester's
        revoked: the task is cancelled)."""
        run = self.current
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
                self._ask_bootstrap("leave", {"id": self.id}, timeout=5 if attempts > 1 else 2)
                print(f"provider {self.id} left the network (confirmed by {self.settings.bootstrap})", flush=True)
                return
            except NetworkError as exc:
                log.warning("leave attempt %d failed: %s", attempt, exc)
                if attempt < attempts:
                    self.clock.sleep(0.5 * attempt)
        print(f"provider {self.id}: the bootstrap did not confirm; it forgets this provider after its TTL", flush=True)

    # ---- handlers --------------------------------------------------------------------------

    def _caller(self, req: Envelope) -> str | None:
        """The key the request's channel proved, as printed (None in plain mode: nothing to check)."""
        if self.keys is None:
            return None
        return key_text(req.peer_key) if req.peer_key is not None else ""

    def _run_of(self, req: Envelope) -> TaskRun:
        task = field_of(req.body, "task", str, max_len=64)
        run = self.runs.get(task)
        if run is None:
            raise BadMessage(f"task {task!r} is not running on {self.id}")
        return run

    def _requesters_run(self, req: Envelope) -> TaskRun:
        """The task ``req`` names, if the caller is the key that claimed it."""
        run = self._run_of(req)
        if (caller := self._caller(req)) is not None:
            run.access.require_requester(caller, req.kind)
        return run

    def _providers_run(self, req: Envelope) -> TaskRun:
        """The task ``req`` names, if the caller is one of its providers (the one whose index it
        gives, where it gives one)."""
        run = self._run_of(req)
        if (caller := self._caller(req)) is not None:
            claimed = req.body.get("index")
            run.access.provider_index(caller, req.kind, claimed if isinstance(claimed, int) else None)
        return run

    def _task_context(self) -> ProviderContext:
        """What a task run here may use of this provider (its limits among it: its message cap as
        given, ``max_message_mb``)."""
        from meshlearn.network.provider.taskrun import ProviderContext  # loads torch: not before a first task

        return ProviderContext(self.id, self.settings.host, self.secret, self.workdir, self.device,
                               Path(self.settings.data_root) if self.settings.data_root else None,
                               self.settings.max_message_mb, self.clock, self.public_host,
                               self.expose, poison=test_poison(), net=test_net(), keep_data=self.settings.keep_data,
                               cores=self.settings.cores, relayed=self.relayed)

    def _assign(self, req: Envelope) -> dict:
        from meshlearn.network.provider.taskrun import TaskRun  # loads torch: not before a first task

        spec = TaskSpec.parse(field_of(req.body, "spec", dict, max_len=10_000))
        task_key = peer_key(field_of(req.body, "key", str, max_len=64), "the task's key")
        access = self._claimed_for(spec, self._caller(req))
        with self._lock:
            earlier = self.runs.get(spec.task_id)
            if earlier is not None:
                earlier.access.require_requester(access.requester, "task.assign")
                if earlier.state.active or earlier.spec == spec:
                    return earlier.status()  # the requester asked again: the same run
            if self.leaving.is_set():
                raise BadMessage(f"provider {self.id} is leaving the network")
            if self._busy():
                raise BadMessage(f"provider {self.id} is busy with task {self.current.spec.task_id}")
            run = TaskRun(spec, self._task_context(), task_key, access, on_change=self._run_changed,
                          fresh=earlier is not None)
            self.runs[spec.task_id] = self.current = run
        threading.Thread(target=run.run, name=f"task-{spec.task_id}", daemon=True).start()
        log.info("task %s accepted (provider %d of %d)", spec.task_id, run.index + 1, len(spec.peers))
        return run.status()

    def _claimed_for(self, spec: TaskSpec, caller: str | None) -> TaskAccess:
        """Who may act on the task ``spec`` describes, once the bootstrap confirms that ``caller``
        claimed it and claimed this provider for it (no check in plain mode)."""
        access = TaskAccess.of(spec, caller or "")
        if caller is None:
            return access
        try:
            record = self._ask_bootstrap("task", {"task": spec.task_id}, timeout=10).body
        except NetworkError as exc:
            raise BadMessage(f"task.assign refused: the bootstrap does not confirm task {spec.task_id} ({exc})") \
                from None
        if record.get("requester_key") != caller:
            raise BadMessage(f"task.assign refused: task {spec.task_id} was claimed by another key")
        if self.id not in {p.get("id") for p in record.get("providers", []) if isinstance(p, dict)}:
            raise BadMessage(f"task.assign refused: task {spec.task_id} did not claim provider {self.id}")
        ids = [p.id for p in spec.peers]
        if self.id not in ids or access.providers[ids.index(self.id)] != self.keys.text:
            raise BadMessage(f"task.assign refused: task {spec.task_id} does not list {self.id} with its key")
        return access

    def _join_task(self, req: Envelope) -> dict:
        """The requester takes another provider into its running task (``TaskRun.add_peer``), or
        withdraws one it took in (``TaskRun.withdraw``)."""
        from meshlearn.network.task.spec import Peer

        run = self._requesters_run(req)
        try:
            peer = Peer(**field_of(req.body, "peer", dict, max_len=4))
        except (UserInputError, TypeError) as exc:
            raise BadMessage(f"task.join: the peer is not a provider's id and address ({exc})") from None
        if req.body.get("withdraw") is True:  # some member could not take it in at its round: go on without it
            run.withdraw(peer)
            return run.status()
        run.add_peer(peer, field_of(req.body, "engine", str, max_len=256), _round_of(req.body, "at", "task.join"))
        return run.status()

    def _start_task(self, req: Envelope) -> dict:
        run = self._requesters_run(req)
        book = field_of(req.body, "engines", dict, max_len=256)
        at = _round_of(req.body, "joins_at", "task.start")
        try:
            run.start({int(k): str(v) for k, v in book.items()}, at)
        except ValueError:
            raise BadMessage("engines must map provider index to address") from None
        return run.status()

    def _results(self, req: Envelope) -> tuple[dict, list]:
        """A finished task's result, for its requester and its providers only (from disk: it
        outlives the run and a restart of this provider)."""
        task = field_of(req.body, "task", str, max_len=64)
        if not task.replace("-", "").replace("_", "").isalnum():
            raise BadMessage(f"task id {task!r} is not valid")
        folder = self.workdir / "tasks" / task
        if (caller := self._caller(req)) is not None:
            access = TaskAccess.load(folder)
            if access is None:
                raise BadMessage(f"{self.id} holds no result for task {task}")
            access.require_member(caller, "task.results")
        found = read_results(folder / "result")
        if found is None:
            raise BadMessage(f"{self.id} holds no result for task {task} (yet)")
        metrics, model, settings = found
        return {"metrics": metrics, "task": (settings or {}).get("task")}, [model]

    def _leave_request(self, req: Envelope) -> dict:
        """``meshlearn leave``: only this provider's own key may make it leave."""
        if (caller := self._caller(req)) is not None and caller != self.keys.text:
            raise BadMessage(f"provider.leave refused: only provider {self.id}'s own key may make it leave (run "
                             "meshlearn leave where it runs, with its --workdir or --key)")
        self.leave()
        return {"leaving": True, "after_task": self.current.spec.task_id if self._busy() else None}


def _round_of(body: dict, name: str, call: str) -> int | None:
    """A round number a requester's ``call`` gives in ``body[name]`` (None where it gives none)."""
    at = body.get(name)
    if at is not None and (not isinstance(at, int) or isinstance(at, bool) or not 0 < at < 1 << 31):
        raise BadMessage(f"{call}: {name} must be a round number")
    return at
