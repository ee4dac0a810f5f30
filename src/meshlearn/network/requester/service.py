"""A requester: submits a training task to the network and gets the model and metrics back (``meshlearn request``)."""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import yaml
from safetensors.torch import load as load_safetensors

from meshlearn.clock import SYSTEM, Clock
from meshlearn.data import Dataset, load_dataset, partition_dataset, test_samples
from meshlearn.errors import (
    NetworkError,
    RemoteError,
    TaskFailed,
    Unreachable,
    UserInputError,
)
from meshlearn.network.channel.addresses import announced_host
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import KeyPair, key_text, pinned, split_pinned
from meshlearn.network.channel.relay import Holder, hold_allocation
from meshlearn.network.channel.rpc import DEFAULT_MAX_BYTES, RpcServer, call
from meshlearn.network.protocol.rpcs import Server, dispatch
from meshlearn.network.requester.taskwatch import TaskWatch
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.datashare import FileShare, dataset_meta, write_shard
from meshlearn.network.task.resources import MemoryEstimate, estimate_memory, wanted_device
from meshlearn.network.task.results import plot_predictions, write_results
from meshlearn.network.task.spec import (
    WEIGHTS_FILE,
    Peer,
    Resumed,
    TaskRequest,
    TaskSettings,
    TaskSpec,
    dataset_spec,
    new_task_id,
)
from meshlearn.network.task.state import KeptCheckpoints, TaskRecord, secret_digest
from meshlearn.tblog import ScalarLog, run_folder
from meshlearn.wire.sealed import FrameSeal

log = logging.getLogger(__name__)

READY_TIMEOUT = 600.0
JOIN_POLL = 1.0  # seconds between looks for a free provider to take into a task with a free slot
JOIN_UNTIL = 0.8  # no provider joins a task whose slowest provider has done more than this share of its cycles
JOIN_LEAD = 2.0  # D-PSGD: seconds of training between naming a newcomer's round and the round's start
CHECKPOINT_BYTES = 1 << 28  # the largest checkpoint a requester takes when it cannot estimate the model
CHECKPOINT_WORKERS = 8  # requests the requester's server handles at once (each may hold a checkpoint)
ASSIGN_TIMEOUT = 15.0  # a provider answers task.assign after one check with the bootstrap
ALL_PROVIDERS = 100_000  # a discover's count that lists every free provider
NEAREST_CANDIDATES = 64  # free providers a requester preferring the nearest pings at most
PING_SAMPLES = 3  # round trips per candidate; the lowest counts
PING_THREADS = 16
WAIT_POLL = 1.0  # seconds between looks at the free providers while waiting for enough
POLL = 0.25  # seconds between looks at the providers' status
SETTLE_EXTRA = 10.0  # seconds beyond the peer timeout that providers get to end their part after the result
ENDED = ("done", "failed", "cancelled")
Say = Callable[[str], None]
__all__ = ["Requester", "TaskFailed", "fetch_results", "results_of_task", "summary_line"]


class Requester:
    """Claims providers, serves them the data, starts the task, follows it and collects the result.

    It keeps the task's state in ``output``: its record (``task.json``) and the checkpoints its
    providers send (``taskstate``). ``resume``: the task of ``record`` goes on from its providers'
    checkpoints of these cycles (one per provider), kept in ``output`` (its providers then are
    asked for first)."""

    def __init__(self, request: TaskRequest, bootstrap: str, secret: bytes, output: Path,
                 host: str = "127.0.0.1", port: int = 0, say: Say = print, dataset: Dataset | None = None,
                 clock: Clock = SYSTEM, advertise: str = "", keys: KeyPair | None = None, tensorboard: str = "",
                 record: TaskRecord | None = None, resume: list[int] | None = None):
        self.request = request
        self.keys = keys  # None: plain ZeroMQ, for tests on loopback only
        self.dataset = dataset  # the task's data, if the caller has loaded it already
        self.bootstrap = bootstrap
        self.secret = secret
        self.output = output
        self.host, self.port = host, port
        self.advertise = advertise
        self.say = say
        self.task_id = record.task_id if record is not None else new_task_id()
        self.record = record or TaskRecord(self.task_id, request, secret_digest(secret, self.task_id))
        self.resume = resume
        self.previous = list(self.record.providers or []) if resume is not None else []
        self._fingerprint = self.record.fingerprint  # the training a resumed task must go on with
        self.kept = KeptCheckpoints(output)
        self._spec_now: TaskSpec | None = None  # the attempt under way (what checkpoints are checked against)
        self.task_key = FrameSeal.new_key()  # seals the providers' engine messages; sent only over CurveZMQ
        self.sender = f"requester-{self.task_id}"
        self.gone: set[str] = set()  # providers out of the task: stopped answering, or revoked
        self.left: set[str] = set()  # providers that went once their part had ended (not lost)
        self._ended: dict[str, bool] = {}  # whether each provider's last status said its part had ended
        self._result_in = False  # the task's result is fetched: a provider that goes now has left, not been lost
        self.revoked: set[str] = set()  # providers whose keys the bootstrap revoked (never asked for a result)
        self.left_out: dict[str, str] = {}  # providers that could not take the task, and why
        self.replaced: dict[str, str] = {}  # a provider left out -> the one claimed in its place
        self._admitted: set[str] = set()  # the keys the data server answers: the task's providers, the bootstrap
        self._joins_closed = False  # a D-PSGD newcomer some member could not take in: no other joins
        self._engines: dict[str, str] = {}  # engine address of each ready provider, by index
        self.estimate: MemoryEstimate | None = None  # the task's peak memory per provider (the data is here)
        self.clock = clock
        scalars = ScalarLog(run_folder(tensorboard, f"task-{self.task_id}")) if tensorboard else None
        self.watch = TaskWatch(self._tell_bootstrap, scalars, clock)  # the bootstrap's dashboard, TensorBoard

    def run(self) -> dict:
        """Run the task to the end; return its metrics (the result is written into ``output``)."""
        req = self.request
        for warning in req.warnings:
            self.say(f"warning: {warning}")
        dataset = self.dataset
        if dataset is None and not req.data_on_providers:
            dataset = load_dataset(dataset_spec(req.data), context=req.context, vocabulary=req.vocabulary)
        if dataset is not None:
            self._plan(dataset)
        self.record.write(self.output)  # from now on the task can be resumed (request --resume)
        claimed = self._claim()
        # cleanup unwinds after the except clause: providers are told to cancel while the share
        # still serves them, so one caught mid-download stops cleanly instead of retrying a file that is gone
        with contextlib.ExitStack() as cleanup:
            try:
                share_dir = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="meshlearn-share-")))
                share = FileShare()
                if req.weights:
                    share.add(WEIGHTS_FILE, Path(req.weights))
                if self.resume is not None:
                    for name, path in self.kept.files(self.resume).items():
                        share.add(name, path)
                serves = dataset is not None or req.weights or self.resume is not None or self.keeps_checkpoints
                address = self._serve(share, claimed, cleanup) if serves else ""
                spec = self._start_on(claimed, share, address, dataset, share_dir)
                self.record.providers, self.record.fingerprint = [p.id for p in spec.peers], spec.fingerprint()
                self.record.write(self.output)
                metrics = self._follow(spec)
                self._result_in = True
                self._settle(spec)
            except BaseException:
                self._cancel(claimed)
                self._release("failed")
                self.watch.finish(None)
                raise
        if dataset is not None:  # the providers are done: drawing the result's predictions holds none of them up
            plot_predictions(self.output, dataset, req.model, req.eval_samples, f"task {self.task_id}")
        self.watch.finish(metrics)
        self._release("done", lost=set(metrics.get("lost", [])) | set(self.left_out))
        self.record.status = "done"
        self.record.write(self.output)
        self.kept.clear()  # a task that is done is never resumed: its checkpoints go
        return metrics

    @property
    def keeps_checkpoints(self) -> bool:
        """Whether the task's providers send checkpoints here (``checkpoint_every`` is not 0)."""
        return self.request.checkpoint_every != 0

    def _take_checkpoint(self, req: Envelope) -> dict:
        """``task.checkpoint``: keep a provider's checkpoint (``KeptCheckpoints.take``)."""
        return self.kept.take(req, self._spec_now, self._check_provider)

    def _check_provider(self, req: Envelope, index: int) -> None:
        """Refuse a request unless its channel proved the key of the running attempt's provider
        ``index`` (no check in plain mode, loopback tests only)."""
        if self.keys is None:
            return
        key = key_text(req.peer_key) if req.peer_key is not None else ""
        TaskAccess.of(self._spec_now, "").provider_index(key, req.kind, index)

    def handlers(self, share: FileShare) -> dict:
        """The data server's dispatch table (declared in ``network.rpcs``): ``share``'s files, and
        the checkpoints its providers send."""
        return dispatch(Server.REQUESTER, {**share.handlers(), "task.checkpoint": self._take_checkpoint})

    def _serve(self, share: FileShare, claimed: list[dict], cleanup: contextlib.ExitStack) -> str:
        """Serve ``share`` (files added later are served too) to the claimed providers and the
        bootstrap (its dial-back) only; returns the pinned address providers fetch from."""
        self._admitted.update({split_pinned(p["address"])[1] for p in claimed} | {split_pinned(self.bootstrap)[1]})
        handlers = self.handlers(share)
        model_bytes = self.estimate.model if self.estimate is not None else CHECKPOINT_BYTES
        server = RpcServer("requester", self.host, self.port, self.secret, handlers, keys=self.keys,
                           admit=lambda key: key in self._admitted, max_bytes=max(DEFAULT_MAX_BYTES, 2 * model_bytes),
                           workers=CHECKPOINT_WORKERS)
        wanted = server.bind_any()
        if wanted:
            self.say(f"port {wanted} is in use: serving the task's data on {server.port} instead")
        server.start()
        cleanup.callback(server.stop)
        return pinned(self._reached_at(server.port, cleanup), self.keys.public if self.keys else None)

    def _start_on(self, claimed: list[dict], share: FileShare, address: str, dataset: Dataset | None,
                  share_dir: Path) -> TaskSpec:
        """Start the task on the claimed providers. One that refuses it, cannot be reached or
        cannot prepare it is left out and, where a free provider matches, replaced by a fresh
        claim (added to ``claimed``): the others are told to drop this attempt, and the task starts
        again (new shards), as long as one is left. Returns the spec that started."""
        plan, attempt = list(claimed), 0
        while True:
            attempt += 1
            spec = self._spec(plan, share, address, dataset, share_dir / f"attempt-{attempt}")
            refused = self._assign_all(spec)
            if not refused:
                break
            self.left_out.update(refused)
            for pid, why in refused.items():
                self.say(f"task {self.task_id}: provider {pid} {why}")
            plan = [p for p in plan if p["id"] not in refused] + self._replace(list(refused), claimed)
            if not plan:
                raise TaskFailed(f"task {self.task_id}: no provider could take it: "
                                 + "; ".join(f"{pid} {why}" for pid, why in self.left_out.items()))
            self.say(f"task {self.task_id}: starting again on {len(plan)} provider(s): "
                     + ", ".join(p["id"] for p in plan))
            self._drop_attempt(spec, plan)
        self._write_config(spec)
        for peer in (p.model_dump() for p in spec.peers):
            try:
                self._call(peer, "task.start", {"engines": self._engines})
            except NetworkError as exc:  # it went between ready and start: the others go on without it
                self._lose(peer["id"], f"did not take the start ({exc})")
        self.say(f"task {self.task_id}: started on {len(spec.peers)} provider(s)")
        return spec

    def _replace(self, drop: list[str], claimed: list[dict]) -> list[dict]:
        """Give ``drop`` back to the bootstrap and claim as many free providers in their place
        (never one left out before); returns those claimed, also added to ``claimed``."""
        try:
            fresh = self._ask_bootstrap("claim.replace", {"task": self.task_id, "drop": drop, **self._wanted(len(drop)),
                                                          "exclude": sorted(self.left_out)})["providers"]
        except (TaskFailed, UserInputError) as exc:  # the task goes on with those it has
            self.say(f"task {self.task_id}: no provider in their place ({exc})")
            return []
        self.replaced.update(zip(drop, (p["id"] for p in fresh)))
        self._admitted.update(split_pinned(p["address"])[1] for p in fresh)
        claimed.extend(fresh)
        self.say(f"task {self.task_id}: in place of {', '.join(drop)}: "
                 + (", ".join(p["id"] for p in fresh) or "no free provider"))
        return fresh

    def _spec(self, plan: list[dict], share: FileShare, address: str, dataset: Dataset | None,
              folder: Path) -> TaskSpec:
        """The task's spec over the providers of ``plan``, their shards written into ``folder``
        and added to ``share``."""
        req = self.request
        data, meta, weights = {"mode": "local", "dataset": req.data_on_providers}, None, None
        if dataset is not None:
            folder.mkdir(parents=True)
            self._write_shares(share, dataset, max(len(plan), self.slots), folder)
            files = share.manifest()
            files.pop(WEIGHTS_FILE, None)
            data, meta = {"mode": "served", "address": address, "files": files}, dataset_meta(dataset)
        if req.weights:
            weights = {"address": address, **share.manifest()[WEIGHTS_FILE]}
        resumed = None
        if self.resume is not None:
            manifest = share.manifest()
            resumed = Resumed(cycles=self.resume, address=address,
                              files={name: manifest[name] for name in self.kept.files(self.resume)})
        self._spec_now = spec = TaskSpec(
            **req.fields_of(TaskSettings), task_id=self.task_id, slots=self.slots,
            peers=[{"id": p["id"], "address": p["address"]} for p in plan], data=data, meta=meta,
            weights=weights, requester=self.sender,
            checkpoints_to=address if self.keeps_checkpoints else "", resume=resumed)
        if self.resume is not None and (len(plan) != len(self.previous) or spec.fingerprint() != self._fingerprint):
            raise TaskFailed(f"task {self.task_id} resumes on its {len(self.previous)} providers' checkpoints: it "
                             f"has {len(plan)} provider(s) now, and must train as it did; start more providers, or "
                             "start the task afresh")
        return spec

    # ---- steps -----------------------------------------------------------------------------

    def _ask_bootstrap(self, kind: str, body: dict) -> dict:
        try:
            return call(self.bootstrap, kind, body, self.secret, timeout=10, sender=self.sender).body
        except Unreachable:
            raise UserInputError(f"no bootstrap answers at {self.bootstrap}: check --bootstrap and that it runs") from None
        except RemoteError as exc:
            raise TaskFailed(f"the bootstrap could not give providers: {exc}") from None

    def _plan(self, dataset: Dataset) -> None:
        """Before any claim: the task's peak memory per provider (``estimate``), and a note when
        the batch is larger than a shard (a provider then trains on batches of its whole shard)."""
        from meshlearn.models import build_model

        req = self.request
        sizes = [len(part) for part in partition_dataset(dataset, req.providers, req.partition, req.seed)]
        smallest, largest = min(sizes), max(sizes)
        if req.batch_size > smallest:
            self.say(f"note: batch size {req.batch_size} is larger than the smallest of {req.providers} shards "
                     f"({smallest} samples): each provider's batches are cut to its shard's size")
        model = build_model(req.model, dataset.input_shape, dataset.num_classes)
        tests = len(test_samples(dataset, req.eval_samples)[1])
        self.estimate = estimate_memory(model, tuple(dataset.input_shape), min(req.batch_size, largest), largest,
                                        tests, req.momentum, tokens=dataset.tokens, outer_copies=req.outer.copies)

    def _needs(self) -> tuple[float, str]:
        """The least RAM (GB) a provider must declare for this task, and why."""
        req = self.request
        estimated = self.estimate.gb if self.estimate is not None else 0.0
        if req.min_ram is not None and req.min_ram >= estimated:
            return req.min_ram, f"--min-ram {req.min_ram:g}"
        return estimated, f"the task needs {self.estimate.describe()} per provider" if self.estimate else ""

    def _wanted(self, count: int) -> dict:
        """A discover's or claim's body: the providers this task may use (docs/network.md, "Choosing providers")."""
        req = self.request
        return {"count": count, "device": req.device, "location": req.location, "min_ram_gb": self._needs()[0],
                "min_cores": req.min_cores or 0, "fallback": req.device_fallback}

    def _free(self) -> list[dict]:
        """Every free provider (at the asked location), whatever its device, RAM and cores."""
        return self._ask_bootstrap("discover", {"count": ALL_PROVIDERS, "location": self.request.location,
                                                "free_only": True})["providers"]

    def _refuse_too_big(self) -> None:
        """A task whose estimated memory exceeds every free provider's declared RAM is refused (one
        line), before any claim."""
        free = self._free()
        if self.estimate is None or not free or any(p["ram_gb"] >= self.estimate.gb for p in free):
            return
        raise UserInputError(f"the task needs {self.estimate.describe()} per provider, more than any free "
                             f"provider declares (at most {max(p['ram_gb'] for p in free):g} GB): choose a smaller "
                             "model or batch size, or more providers (smaller shards)")

    def _say_skipped(self) -> None:
        """Say which free providers this task skips for their RAM or cores, and fail in one line
        when none of the asked device is free (without --device-fallback)."""
        req = self.request
        free = self._free()
        need, why = self._needs()
        low_ram = [p for p in free if p["ram_gb"] < need]
        if low_ram:
            self.say(f"skipped for too little RAM ({why}): "
                     + ", ".join(f"{p['id']} ({p['ram_gb']:g} GB)" for p in low_ram))
        few_cores = [p for p in free if p["cores"] < (req.min_cores or 0) and p not in low_ram]
        if few_cores:
            self.say(f"skipped for fewer cores than --min-cores {req.min_cores}: "
                     + ", ".join(f"{p['id']} ({p['cores']})" for p in few_cores))
        wanted = wanted_device(req.device)
        fit = [p for p in free if p not in low_ram and p not in few_cores]
        if wanted and fit and not req.device_fallback and not any(p["device"] == wanted for p in fit):
            others = Counter(p["device"] for p in fit)
            raise TaskFailed(f"no free {wanted} provider (free: " + ", ".join(f"{n} {d}" for d, n in others.items())
                             + "): wait for one with --wait, or let others take the task with --device-fallback")

    def _say_devices(self, claimed: list[dict]) -> None:
        """One line when fewer providers of the asked device were free than asked: those taken
        alone, or (with --device-fallback) which others were taken."""
        req = self.request
        wanted = wanted_device(req.device)
        if wanted is None or len(claimed) >= req.providers and all(p["device"] == wanted for p in claimed):
            return
        ours = sum(p["device"] == wanted for p in claimed)
        others = [p for p in claimed if p["device"] != wanted]
        if others:
            self.say(f"only {ours} free {wanted} provider(s) of the {req.providers} asked: also taking "
                     + ", ".join(f"{p['id']} ({p['device']})" for p in others) + " (--device-fallback)")
        else:
            self.say(f"only {ours} free {wanted} provider(s) of the {req.providers} asked: training on those "
                     "(--device-fallback takes other devices too)")

    def _wait_for_providers(self) -> None:
        """Wait (up to the request's ``wait``) until as many providers as asked are free (of the
        asked device, with the RAM and cores the task needs), saying how many are whenever that
        changes. Nothing is claimed meanwhile, so Ctrl-C leaves nothing behind."""
        req = self.request
        wanted = {**self._wanted(req.providers), "free_only": True}  # with --device-fallback: any device
        device = wanted_device(req.device)
        kind = f"free {device} provider(s)" if device else "free provider(s)"
        deadline, said = self.clock.monotonic() + req.wait, None
        while True:
            free = len(self._ask_bootstrap("discover", wanted)["providers"])
            left = deadline - self.clock.monotonic()
            if free >= req.providers or left <= 0:
                return
            if free != said:
                self.say(f"waiting up to {left:.0f} s for {req.providers} {kind}: {free} now "
                         "(--wait 0 takes those free at once)")
                said = free
            self.clock.sleep(min(WAIT_POLL, left))

    def nearest(self) -> list[str]:
        """The free candidates' ids (up to NEAREST_CANDIDATES, with the request's filters), nearest
        first: by the lowest of a few round-trip times over the encrypted channel (a ping, a fresh
        connection each, as every task message makes); one that does not answer comes last."""
        found = self._ask_bootstrap("discover", {**self._wanted(NEAREST_CANDIDATES), "free_only": True})["providers"]
        with ThreadPoolExecutor(max_workers=PING_THREADS) as pool:
            times = dict(zip((p["id"] for p in found), pool.map(self._round_trip, found)))
        order = sorted(times, key=times.get)
        if order:
            self.say("round-trip times: " + ", ".join(
                f"{pid} {times[pid] * 1000:.0f} ms" if math.isfinite(times[pid]) else f"{pid} no answer"
                for pid in order))
        return order

    def _round_trip(self, peer: dict) -> float:
        best = math.inf
        for _ in range(PING_SAMPLES):
            started = self.clock.monotonic()
            try:
                call(peer["address"], "ping", {}, self.secret, timeout=2.0, sender=self.sender)
            except NetworkError:
                return math.inf
            best = min(best, self.clock.monotonic() - started)
        return best

    def _claim(self) -> list[dict]:
        req = self.request
        self._refuse_too_big()
        if req.wait > 0:
            self._wait_for_providers()
        self._say_skipped()
        order = self.nearest() if req.prefer == "nearest" else []
        if self.previous:  # a resumed task: its providers of then first, if they came back
            order = self.previous + [pid for pid in order if pid not in self.previous]
        claimed = self._ask_bootstrap("claim", {"task": self.task_id, **self._wanted(req.providers),
                                                "order": order})["providers"]
        if wanted_device(req.device):
            self._say_devices(claimed)
        elif len(claimed) < req.providers:
            if self.slots and len(claimed) < (req.min_providers or 1):
                raise TaskFailed(f"task {self.task_id}: {len(claimed)} provider(s) free, fewer than --min-providers "
                                 f"{req.min_providers}: wait for more (--wait) or ask for fewer")
            self.say(f"only {len(claimed)} provider(s) available of the {req.providers} asked: using those"
                     + (", taking in more as they come free" if self.slots else ""))
        devices = Counter(p["device"] for p in claimed)
        self.say(f"task {self.task_id}: {len(claimed)} provider(s): " + ", ".join(p["id"] for p in claimed)
                 + " (" + ", ".join(f"{n} {d}" for d, n in devices.most_common()) + ")")
        return claimed

    def _reached_at(self, port: int, cleanup: contextlib.ExitStack) -> str:
        """HOST:PORT where providers fetch the data: this machine's if the bootstrap can dial it,
        else an allocation of the bootstrap's relay (this requester is behind NAT)."""
        address = f"{announced_host(self.host, self.advertise, self.bootstrap)}:{port}"
        if self.keys is None:
            return address
        probe = call(self.bootstrap, "probe", {"address": address}, self.secret, timeout=15, sender=self.sender).body
        if probe.get("reachable") is not False:
            return address
        allocation = hold_allocation(
            lambda kind, body: call(self.bootstrap, kind, body, self.secret, timeout=10, sender=self.sender).body,
            self.host, port, Holder("task", self.task_id))
        cleanup.callback(allocation.close)
        self.say(f"task {self.task_id}: the bootstrap cannot reach {address} (NAT or a firewall): "
                 f"providers fetch the data through the relay at {allocation.address}")
        return allocation.address

    def _write_shares(self, share: FileShare, dataset, count: int, folder: Path) -> None:
        """Each provider's shard and the test set, written into ``folder`` and offered by ``share``."""
        req = self.request
        parts = partition_dataset(dataset, count, req.partition, req.seed)
        for i, indices in enumerate(parts):
            path = folder / f"shard-{i}.safetensors"
            write_shard(path, dataset.train_x[indices], dataset.train_y[indices])
            share.add(path.name, path)
        test = folder / "test.safetensors"
        write_shard(test, *test_samples(dataset, req.eval_samples))
        share.add(test.name, test)

    def _write_config(self, spec: TaskSpec) -> None:
        self.output.mkdir(parents=True, exist_ok=True)
        resolved = {"task": spec.settings(), "data": self.request.data,
                    "weights": self.request.weights,
                    "data_on_providers": self.request.data_on_providers, "bootstrap": self.bootstrap,
                    "warnings": self.request.warnings}
        (self.output / "task.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))

    def _call(self, peer: dict, kind: str, body: dict, timeout: float = 10.0):
        return call(peer["address"], kind, {"task": self.task_id, **body}, self.secret, timeout=timeout,
                    sender=self.sender, max_bytes=1 << 30)

    def _assign_all(self, spec: TaskSpec) -> dict[str, str]:
        """Give every provider of ``spec`` the task and wait until each is ready (its engine's
        address in ``_engines``); returns why each one that could not be used was not (empty:
        all are ready)."""
        peers = [p.model_dump() for p in spec.peers]
        refused: dict[str, str] = {}
        for peer in peers:
            try:
                self._call(peer, "task.assign", {"spec": spec.model_dump(), "key": key_text(self.task_key)},
                           timeout=ASSIGN_TIMEOUT)
            except NetworkError as exc:
                refused[peer["id"]] = f"refused the task or did not answer ({exc})"
        if refused:
            return refused
        deadline = self.clock.monotonic() + READY_TIMEOUT
        self._engines = {}
        while len(self._engines) + len(refused) < len(peers):
            for i, peer in enumerate(peers):
                if str(i) in self._engines or peer["id"] in refused:
                    continue
                try:
                    status = self._call(peer, "task.status", {}).body
                except NetworkError as exc:
                    refused[peer["id"]] = f"stopped answering while it prepared the task ({exc})"
                    continue
                if status["state"] in ("failed", "cancelled"):
                    refused[peer["id"]] = f"could not prepare the task: {status['error'] or status['state']}"
                elif status["state"] != "preparing":
                    self._engines[str(i)] = status["engine"]
            if self.clock.monotonic() > deadline:
                refused.update({p["id"]: "did not get ready in time (data download or model build)"
                                for i, p in enumerate(peers) if str(i) not in self._engines})
            self.clock.sleep(POLL)
        return refused

    def _drop_attempt(self, spec: TaskSpec, plan: list[dict]) -> None:
        """Tell every provider of ``spec`` to drop that attempt (one left out may still be
        preparing it), and wait (a little) until those of ``plan`` have, so each takes the next."""
        self._cancel([p.model_dump() for p in spec.peers])
        deadline = self.clock.monotonic() + SETTLE_EXTRA
        for peer in plan:
            while self.clock.monotonic() < deadline:
                try:
                    if self._call(peer, "task.status", {}, timeout=5).body["state"] in ENDED:
                        break
                except NetworkError:
                    break
                self.clock.sleep(POLL)

    def _lose(self, provider: str, why: str) -> None:
        """``provider`` is out of the task from now on (gone, or its key revoked): say so once."""
        if provider not in self.gone:
            self.gone.add(provider)
            self.watch.lost(provider)
            self.say(f"task {self.task_id}: provider {provider} {why}")

    def _statuses(self, spec: TaskSpec) -> list[tuple[dict, dict]]:
        """(provider, status) of every provider still answering; the others join ``gone``, except
        one whose part had ended or that said it was leaving (it goes once its part ends), or any
        once the result is in: those left, they were not lost."""
        states = []
        for peer in (p.model_dump() for p in spec.peers):
            if peer["id"] in self.gone or peer["id"] in self.left:
                continue
            try:
                status = self._call(peer, "task.status", {}, timeout=5).body
                states.append((peer, status))
                # a provider told to leave goes as soon as its part ends, maybe between two looks
                self._ended[peer["id"]] = status.get("state") in ENDED or status.get("leaving") is True
            except NetworkError:  # gone, refusing, or its connection dropped mid-handshake
                if self._ended.get(peer["id"]) or self._result_in or peer["id"] in self._ask_left():
                    self.left.add(peer["id"])
                    self.say(f"task {self.task_id}: provider {peer['id']} went, as it said it would (leaving), "
                             "or after the result")
                else:
                    self._lose(peer["id"], "stopped answering")
        self.watch.update(states)
        for pid in self.revoked - self.gone:  # told by the bootstrap, with a progress report
            self._lose(pid, "was revoked: it is out of the task")
        return [(peer, status) for peer, status in states if peer["id"] not in self.gone]

    @property
    def slots(self) -> int:
        """The most providers the task takes (its data split as many ways) where more may join it as
        it runs (``min_providers``); 0: the task keeps the providers it starts with."""
        req = self.request
        return req.providers if req.min_providers is not None and req.min_providers < req.providers else 0

    def _take_in(self, spec: TaskSpec, states: list[tuple[dict, dict]]) -> TaskSpec:
        """While the task has a free slot (never filled, or its provider lost) and is not near its
        end: claim a free provider and take it in (its spec, with ``joining``, and the lost one's
        shard where it takes its place; the running providers told of it; started with their
        engines). Returns the task's spec as it is now."""
        progress = [s["progress"] for _, s in states if s.get("progress", {}).get("iterations")]
        shard = self._free_shard(spec)
        if shard is None or not progress or self._joins_closed or \
                min(p.get("iteration", 0) / p["iterations"] for p in progress) > JOIN_UNTIL:
            return spec
        fresh = self._ask_bootstrap("claim.replace", {"task": self.task_id, "drop": [], **self._wanted(1),
                                                      "exclude": sorted(set(self.left_out) | self.gone)})["providers"]
        if not fresh:
            return spec
        peer, index = fresh[0], len(spec.peers)
        self._admitted.add(split_pinned(peer["address"])[1])
        newcomer = Peer(id=peer["id"], address=peer["address"], shard=None if shard == index else shard)
        joined = spec.model_copy(update={"peers": [*spec.peers, newcomer], "joining": True})
        started = self.clock.monotonic()
        seen = (started, max(p.get("iteration", 0) for p in progress))
        try:
            self._call(peer, "task.assign", {"spec": joined.model_dump(), "key": key_text(self.task_key)},
                       timeout=ASSIGN_TIMEOUT)
            engine = self._engine_of(peer)
            at = self._join_round(spec, seen) if self.request.algorithm == "dpsgd" else None
            join = {"peer": joined.peers[index].model_dump(), "engine": engine, **({"at": at} if at else {})}
            took = []
            for member in spec.peers:
                if member.id not in self.gone and member.id not in self.left:
                    try:
                        self._call(member.model_dump(), "task.join", join)
                        took.append(member)
                    except NetworkError as exc:
                        if at is not None:  # a round already begun there: every member must take it in at one
                            self._withdraw(took, join)
                            raise NetworkError(f"{member.id} could not take it in at round {at} ({exc})") from None
                        self._lose(member.id, f"did not take in {peer['id']} ({exc})")
            engines = {i: address for i, address in self._engines.items() if spec.peers[int(i)].id not in self.gone}
            self._call(peer, "task.start", {"engines": engines, **({"joins_at": at} if at else {})})
        except NetworkError as exc:
            self.left_out[peer["id"]] = f"could not join the running task ({exc})"
            self._cancel([peer])
            self.say(f"task {self.task_id}: provider {peer['id']} could not join: {exc}")
            return spec
        self._engines[str(index)] = engine
        self._spec_now = spec = joined.model_copy(update={"joining": False})
        self.record.providers = [p.id for p in spec.peers]
        self.record.write(self.output)
        instead = [p.id for i, p in enumerate(spec.peers[:-1]) if spec.shard_of(i) == shard and p.id in self.gone]
        if instead:  # the lost provider whose shard it took
            self.replaced[instead[-1]] = peer["id"]
        self.say(f"task {self.task_id}: provider {peer['id']} joined as provider {index}"
                 + (f" in place of {instead[-1]} (its shard)" if instead else "")
                 + f" ({self.clock.monotonic() - started:.1f} s from its claim)")
        return spec

    def _free_shard(self, spec: TaskSpec) -> int | None:
        """The shard a provider joining the task now trains on: the next slot's, else that of a
        provider the task lost (None: every slot is held)."""
        if not self.slots:
            return None
        if len(spec.peers) < self.slots:
            return len(spec.peers)
        held = {spec.shard_of(i) for i, p in enumerate(spec.peers) if p.id not in self.gone}
        return min(set(range(self.slots)) - held, default=None)

    def _join_round(self, spec: TaskSpec, seen: tuple[float, int]) -> int:
        """The round a D-PSGD newcomer joins at: ``JOIN_LEAD`` seconds of training after the round the
        fastest provider is at now, at the pace seen since ``seen`` (when, and the round it was at)."""
        now = self.clock.monotonic()
        progress = [s.get("progress", {}) for _, s in self._statuses(spec)]
        latest = max((p.get("iteration", 0) for p in progress), default=seen[1])
        pace = (latest - seen[1]) / max(now - seen[0], 1e-3)
        at = latest + 2 + math.ceil(pace * JOIN_LEAD)
        if at >= min((p.get("iterations", 0) for p in progress), default=0):
            raise NetworkError(f"the task ends before round {at}, the first it could join at")
        return at

    def _withdraw(self, took: list[Peer], join: dict) -> None:
        """A newcomer some members could not take in at its round: the members that did go on
        without it (as without a revoked provider), and no other provider joins the task."""
        self._joins_closed = True
        for member in took:
            try:
                self._call(member.model_dump(), "task.join", {**join, "withdraw": True})
            except NetworkError as exc:
                self._lose(member.id, f"did not let {join['peer']['id']} go ({exc})")

    def _engine_of(self, peer: dict) -> str:
        """The engine address of a provider preparing the task, once it is ready (NetworkError if it
        fails or takes too long)."""
        deadline = self.clock.monotonic() + READY_TIMEOUT
        while self.clock.monotonic() < deadline:
            status = self._call(peer, "task.status", {}).body
            if status["state"] in ("failed", "cancelled"):
                raise NetworkError(f"it could not prepare the task: {status.get('error') or status['state']}")
            if status["state"] != "preparing":
                return status["engine"]
            self.clock.sleep(POLL)
        raise NetworkError("it did not get ready in time")

    def _follow(self, spec: TaskSpec) -> dict:
        last_line = ""
        last_claim = self.clock.monotonic()
        while True:
            states = self._statuses(spec)
            if self.slots and self.clock.monotonic() - last_claim > JOIN_POLL:
                spec, last_claim = self._take_in(spec, states), self.clock.monotonic()
            holders = [peer for peer, status in states if status.get("results")]
            if holders:  # the result: from a provider that is still in the task (asked at this moment)
                revoked = self._note_revoked(self._ask_revoked())
                trusted = [peer for peer in holders if peer["id"] not in revoked]
                metrics = fetch_results(self.task_id, trusted, self.secret, self.output, extra=self._extra(),
                                        name=self._result_name(spec))
                if metrics is not None:
                    return metrics
            if not states:
                raise TaskFailed(f"task {self.task_id}: every provider is gone; no result")
            if all(s["state"] in ENDED for _, s in states):
                raise TaskFailed(f"task {self.task_id} ended without a result: "
                                 + "; ".join(f"{p['id']} {s['state']}" + (f" ({s['error']})" if s.get("error") else "")
                                             for p, s in states))
            line = "  ".join(f"{p['id']}: {s['state']}" + _count(s["progress"]) for p, s in states)
            if line != last_line:
                self.say(f"task {self.task_id}: {line}")
                last_line = line
            self.clock.sleep(2 * POLL)

    def _cancel(self, peers: list[dict]) -> None:
        """Tell every provider to drop the task (best effort), so none stays busy with it."""
        for peer in peers:
            try:
                self._call(peer, "task.cancel", {}, timeout=3)
            except NetworkError:
                pass

    def _settle(self, spec: TaskSpec) -> None:
        """Wait (a little) until every provider still answering has ended its part of the task,
        so none is shown busy once the result is in."""
        deadline = self.clock.monotonic() + spec.peer_timeout + SETTLE_EXTRA
        while self.clock.monotonic() < deadline:
            if all(status["state"] in ENDED for _, status in self._statuses(spec)):
                return
            self.clock.sleep(POLL)
        log.warning("task %s: some providers did not end their part in time", self.task_id)

    def _tell_bootstrap(self, body: dict) -> None:
        """One progress report of this task for the bootstrap's dashboard (TaskWatch sends it);
        the reply names the task's providers whose keys were revoked since."""
        reply = call(self.bootstrap, "task.progress", {"task": self.task_id, **body}, self.secret, timeout=3,
                     sender=self.sender)
        self._note_revoked(reply.body.get("revoked"))

    def _task_record(self) -> dict:
        """The bootstrap's record of this task (its providers, those revoked, those that left the
        network); empty if it cannot say now."""
        try:
            return call(self.bootstrap, "task", {"task": self.task_id}, self.secret, timeout=5,
                        sender=self.sender).body
        except NetworkError as exc:
            log.info("could not ask the bootstrap for the task's record: %s", exc)
            return {}

    def _ask_left(self) -> list[str]:
        """The task's providers the bootstrap saw leave the network (a provider told to leave goes
        once its part ends, maybe between two of the requester's looks); empty if it cannot say."""
        left = self._task_record().get("left")
        return [p for p in left if isinstance(p, str)] if isinstance(left, list) else []

    def _ask_revoked(self) -> object:
        """The bootstrap's list of this task's revoked providers (None if it cannot say now)."""
        return self._task_record().get("revoked")

    def _note_revoked(self, revoked: object) -> set[str]:
        """Remember the providers the bootstrap says were revoked (never trusted again); returns them all."""
        if isinstance(revoked, list):
            self.revoked.update(p for p in revoked if isinstance(p, str))
        return self.revoked

    def _result_name(self, spec: TaskSpec) -> str:
        """The task as its confusion.png names it: its id, model, data and algorithm."""
        req = self.request
        return (f"task {self.task_id} ({req.model} on {req.data or req.data_on_providers}, {spec.algorithm}, "
                f"{len(spec.peers)} providers)")

    def _extra(self) -> dict:
        """What the requester adds to the result's metrics: providers left out before the start,
        and those claimed in their place."""
        return {**({"left_out": dict(self.left_out)} if self.left_out else {}),
                **({"replaced": dict(self.replaced)} if self.replaced else {})}

    def _release(self, status: str, lost: set[str] = frozenset()) -> None:
        try:
            call(self.bootstrap, "release", {"task": self.task_id, "status": status,
                                             "lost": sorted(set(lost) | self.gone)}, self.secret,
                 timeout=5, sender=self.sender)
        except NetworkError as exc:
            log.warning("could not tell the bootstrap that task %s ended: %s", self.task_id, exc)


def fetch_results(task_id: str, peers: list[dict], secret: bytes, output: Path,
                  extra: dict | None = None, name: str = "") -> dict | None:
    """Get a task's result from the first provider that holds it; write it, with ``extra``
    metrics, into ``output``, its figure naming it ``name`` (by default ``task TASK_ID``)."""
    for peer in peers:
        try:
            reply = call(peer["address"], "task.results", {"task": task_id}, secret, timeout=30,
                         sender=f"requester-{task_id}", max_bytes=1 << 30)
        except NetworkError:  # gone, refusing, or its connection dropped mid-handshake
            continue
        if len(reply.blobs) != 1:
            continue
        model = bytes(reply.blobs[0])
        try:
            load_safetensors(model)
        except Exception:  # noqa: BLE001 - a corrupt copy: try the next provider
            log.warning("the result from %s is not a valid safetensors model", peer["id"])
            continue
        metrics = {**dict(reply.body.get("metrics") or {}), **(extra or {})}
        metrics["fetched_from"] = peer["id"]
        settings = reply.body.get("task")
        task = {"task": settings if _is_task_settings(settings) else None, "fetched_from": peer["id"]}
        write_results(output, metrics, model, title=name or f"task {task_id}", task=task)
        return metrics
    return None


def _is_task_settings(value) -> bool:
    """A provider's copy of the task settings is kept only if it looks like them: TaskSpec's keys,
    plain JSON values at most three levels deep (it goes into task.yaml, nothing more)."""
    def plain(item, depth: int) -> bool:
        if isinstance(item, (str, int, float, bool, type(None))):
            return True
        if depth == 0:
            return False
        if isinstance(item, list):
            return len(item) <= 1024 and all(plain(x, depth - 1) for x in item)
        return isinstance(item, dict) and len(item) <= 64 and all(
            isinstance(k, str) and plain(v, depth - 1) for k, v in item.items())
    return isinstance(value, dict) and set(value) <= set(TaskSpec.model_fields) and plain(value, 3)


def results_of_task(task_id: str, bootstrap: str, secret: bytes, output: Path) -> dict:
    """``meshlearn results TASK_ID``: ask the bootstrap who ran the task, fetch the result from any of them."""
    try:
        record = call(bootstrap, "task", {"task": task_id}, secret, timeout=10).body
    except Unreachable:
        raise UserInputError(f"no bootstrap answers at {bootstrap}: check --bootstrap") from None
    except RemoteError as exc:
        raise UserInputError(str(exc)) from None
    metrics = fetch_results(task_id, record["providers"], secret, output)
    if metrics is None:
        raise TaskFailed(f"no provider of task {task_id} holds its result (yet)")
    return metrics


def _count(progress: dict) -> str:
    """`` 7/10`` once a provider knows how many iterations its part has; nothing before."""
    total = progress.get("iterations")
    return f" {progress.get('iteration', 0)}/{total}" if total else ""


def summary_line(metrics: dict) -> str:
    """One line of a task's result: scores, time, leader, and the providers lost or suspected."""
    scores = f"perplexity {metrics['perplexity']:.3f}  bits per token {metrics['bits_per_token']:.3f}" \
        if "perplexity" in metrics else f"accuracy {metrics['accuracy']:.4f}  F1 {metrics['f1']:.4f}"
    return (f"{scores}  loss {metrics['loss']:.4f}  "
            f"time {metrics['training_time']:.1f} s  leader {metrics['leader']}"
            + (f"  lost: {', '.join(metrics['lost'])}" if metrics.get("lost") else "")
            + (f"  suspected: {', '.join(metrics['suspected'])}" if metrics.get("suspected") else "")
            + (f"  models refused from: {', '.join(metrics['refused_from'])} (not robust: honest ones too)"
               if metrics.get("refused_from") else "")
            + (f"  DP epsilon {metrics['privacy']['epsilon']:.3g} at delta {metrics['privacy']['delta']:g}"
               if metrics.get("privacy") else ""))


