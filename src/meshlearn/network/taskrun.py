"""One provider's part of a task: get the data, train with the task's algorithm, agree on the result.

The engine's Node trains in every case. ``dpsgd`` and ``gossip`` exchange through the engine's
own transports; ``leader`` trains with no engine exchange and pushes its model to the leader
every aggregation cycle (``aggregation.LeaderState``). At the end every algorithm does the same:
final models go to the leader, which averages, evaluates, and copies the result to every
provider. The leader is always the lowest-indexed provider of the task that answers a ping, so
when it dies the others agree on its successor without a vote.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from meshlearn.config import make_config
from meshlearn.data import load_dataset, partition
from meshlearn.models import build_model, load_weights
from meshlearn.network.aggregation import LeaderState
from meshlearn.network.datashare import dataset_from_shards, download, read_shard
from meshlearn.network.envelope import BadMessage, Envelope, NetworkError, field_of
from meshlearn.network.results import write_results
from meshlearn.network.rpc import RemoteError, Unreachable, call
from meshlearn.network.task import WEIGHTS_FILE, TaskSpec
from meshlearn.node import Node, evaluate_model, make_transport
from meshlearn.topology import build_topology
from meshlearn.wire import Kind, Message, decode, encode

log = logging.getLogger(__name__)

START_TIMEOUT = 600.0
CANCEL_WAIT = 2.0  # seconds task.cancel waits for the run to stop, so the provider is free when it answers


class TaskCancelled(Exception):
    """Raised inside a task run when its requester cancels it."""


@dataclass
class ProviderContext:
    """What a task run may use of its provider: identity, secret, folders, device and limits."""

    id: str
    host: str
    secret: bytes
    workdir: Path
    device: str = "cpu"
    data_root: Path | None = None
    max_message_bytes: int = 512 * 1024 * 1024


class TaskRun:
    """A task on this provider; ``run()`` does the work, the ``on_*`` methods answer its peers."""

    def __init__(self, spec: TaskSpec, ctx: ProviderContext):
        self.spec = spec
        self.ctx = ctx
        ids = [p.id for p in spec.peers]
        if ctx.id not in ids:
            raise BadMessage(f"task {spec.task_id} does not list this provider ({ctx.id})")
        self.index = ids.index(ctx.id)
        self.ids = ids
        self.folder = ctx.workdir / "tasks" / spec.task_id
        self.state = "preparing"
        self.error: str | None = None
        self.progress: dict = {}
        self.engine_address = ""
        self.leader = 0
        self.dead: set[int] = set()
        self.leader_state: LeaderState | None = None
        self.node: Node | None = None
        self.results_ready = threading.Event()
        self._start = threading.Event()
        self._book: dict[int, str] = {}
        self._lock = threading.RLock()
        self._stop_pinging = threading.Event()
        self._ended = threading.Event()
        self._started_at = 0.0
        self._final_sent_to: int | None = None
        self._cancelled = False

    # ---- the run ---------------------------------------------------------------------------

    def run(self) -> None:
        """Prepare, wait for the requester's start, train, finish; record a failure instead of raising."""
        try:
            self._prepare()
            self.state = "ready"
            if not self._start.wait(START_TIMEOUT):
                raise NetworkError(f"the requester never started task {self.spec.task_id}")
            self._check_cancelled()
            self.state = "training"
            self._started_at = time.monotonic()
            pinger = threading.Thread(target=self._watch_leader, daemon=True, name="leader-watch")
            pinger.start()
            self.node.run(self._book)
            self.state = "finishing"
            self._finish()
            self.state = "done"
        except TaskCancelled:
            self.state = "cancelled"
            log.warning("task %s cancelled by its requester", self.spec.task_id)
        except Exception as exc:  # noqa: BLE001 - the requester reads the reason from status
            self.error = f"{type(exc).__name__}: {exc}"
            self.state = "failed"
            log.exception("task %s failed on %s", self.spec.task_id, self.ctx.id)
        finally:
            self._stop_pinging.set()
            self._ended.set()

    def _prepare(self) -> None:
        spec = self.spec
        dataset, indices = self._load_data()
        self.samples = len(indices)
        batches_per_epoch = math.ceil(self.samples / min(spec.batch_size, self.samples))
        every = batches_per_epoch if spec.aggregate_every == "epoch" else spec.aggregate_every
        iterations = math.ceil(spec.epochs * batches_per_epoch / every)
        config = make_config({
            "nodes": max(2, len(self.ids)), "algorithm": "local" if spec.algorithm == "leader" else spec.algorithm,
            "topology": "full", "rounds": every, "iterations": iterations, "batch_size": spec.batch_size,
            "lr": spec.lr, "momentum": spec.momentum, "seed": spec.seed, "test_after": iterations,
            "eval_samples": spec.eval_samples,
            "eval_nodes": 1, "wait_timeout": spec.peer_timeout, "handshake_timeout": 3 * spec.peer_timeout,
            "host": self.ctx.host, "device": self.ctx.device,
            "max_message_mb": self.ctx.max_message_bytes / 2 ** 20,
        })
        graph = build_topology("full", max(2, len(self.ids)), spec.seed)
        torch.manual_seed(spec.seed)  # every provider starts from the same model
        model = build_model(spec.model, dataset.input_shape, dataset.num_classes)
        if spec.weights is not None:  # the requester's initial weights replace the seeded ones
            if spec.weights.size > self.ctx.max_message_bytes:
                raise BadMessage(f"initial weights of {spec.weights.size} bytes exceed this provider's "
                                 f"{self.ctx.max_message_bytes}-byte limit")
            path = download(spec.weights.address, WEIGHTS_FILE, spec.weights.model_dump(), self.folder / "data",
                            self.ctx.secret, sender=self.ctx.id, before_chunk=self._check_cancelled)
            load_weights(model, str(path))
        self.node = Node(self.index, config, graph, dataset, indices, model,
                         lambda flat: make_transport(config, self.index, flat, self.ctx.host, 0, self.ctx.secret))
        self.engine_address = self.node.transport.bind()
        self.node.hooks.append(self._after_iteration)
        self.iterations = iterations

    def _load_data(self):
        spec, data = self.spec, self.spec.data
        mode = data.get("mode")
        if mode == "served":
            address, files = str(data.get("address", "")), data.get("files")
            name = f"shard-{self.index}.safetensors"
            if not isinstance(files, dict) or name not in files or "test.safetensors" not in files or spec.meta is None:
                raise BadMessage("served data must list this provider's shard and test.safetensors, with meta")
            folder = self.folder / "data"
            shard = download(address, name, files[name], folder, self.ctx.secret, sender=self.ctx.id,
                             before_chunk=self._check_cancelled)
            test = download(address, "test.safetensors", files["test.safetensors"], folder, self.ctx.secret,
                            sender=self.ctx.id, before_chunk=self._check_cancelled)
            dataset = dataset_from_shards(spec.meta, read_shard(shard), read_shard(test))
            return dataset, list(range(len(dataset.train_y)))
        if mode == "local":
            dataset = load_dataset(self._allowed_local(str(data.get("dataset", ""))))
            parts = partition(dataset.train_y.numpy(), len(self.ids), spec.partition, spec.seed)
            return dataset, parts[self.index]
        raise BadMessage(f"data mode {mode!r} is not served or local")

    def _allowed_local(self, dataset: str) -> str:
        """A dataset on this machine, only inside the folder the operator allowed (``--data-root``)."""
        kind, sep, path = dataset.partition(":")
        if not sep:
            return dataset  # an embedded dataset such as digits
        root = self.ctx.data_root
        if root is None:
            raise BadMessage("this provider serves no local data: its operator did not pass --data-root")
        resolved = (root / path).resolve()
        if not resolved.is_relative_to(root.resolve()):
            raise BadMessage(f"local data {path!r} is outside this provider's data root")
        return f"{kind}:{resolved}"

    def cancel(self, wait: float = CANCEL_WAIT) -> None:
        """Stop this task at its next data chunk or iteration (the requester gave up on it);
        return once it has stopped, or after ``wait`` seconds."""
        self._cancelled = True
        self._start.set()
        self._ended.wait(wait)

    def _check_cancelled(self) -> None:
        if self._cancelled:
            raise TaskCancelled(self.spec.task_id)

    def _after_iteration(self, node: Node, iteration: int, record: dict) -> None:
        self._check_cancelled()
        self.progress = {"iteration": iteration + 1, "iterations": self.iterations,
                         "train_loss": record.get("train_loss"), "leader": self.ids[self.leader]}
        if self.spec.algorithm == "leader":
            self._exchange(final=iteration + 1 == self.iterations)

    # ---- leader aggregation ---------------------------------------------------------------

    def _vector_message(self, vector: torch.Tensor, final: bool) -> list:
        return encode(Message(Kind.MODEL, self.index, int(final), 0, self.node.flat.segments_of(vector)))

    def _vector_of(self, blobs: list) -> torch.Tensor:
        msg = decode(blobs, self.ctx.max_message_bytes)
        problem = self.node.flat.check_compatible(msg.tensors)
        if problem:
            raise BadMessage(f"model does not fit this task: {problem}")
        return torch.cat([msg.tensors[name] for name in self.node.flat.ranges])

    def _lead(self) -> LeaderState:
        with self._lock:
            if self.leader_state is None:
                alive = [i for i in range(len(self.ids)) if i not in self.dead]
                first = self.index == 0 and self.spec.algorithm == "leader" and self.state != "finishing"
                self.leader_state = LeaderState(alive, self.spec.peer_timeout, barrier=first)
                if self.index != 0:
                    log.warning("task %s: %s takes over as leader", self.spec.task_id, self.ctx.id)
            return self.leader_state

    def _exchange(self, final: bool) -> None:
        """Hand this provider's model to the leader and take the average back."""
        flat = self.node.flat
        while True:
            # the watcher keeps ``self.leader`` current; resolving (pinging) again only after a failure
            leader = self.leader if self.leader not in self.dead else self._resolve_leader()
            if leader == self.index:
                average = self._lead().submit(self.index, flat.state, self.samples, final)
                flat.state.copy_(average)
                return
            try:
                reply = self._push(leader, final)
            except Unreachable:
                self._mark_dead(leader)
                self._resolve_leader()
                continue
            except RemoteError as exc:
                log.warning("task %s: push to %s refused: %s", self.spec.task_id, self.ids[leader], exc)
                time.sleep(0.5)
                self._resolve_leader()
                continue
            flat.state.copy_(self._vector_of(reply.blobs))
            return

    def _push(self, leader: int, final: bool) -> Envelope:
        reply = call(self._address(leader), "agg.push",
                     {"task": self.spec.task_id, "index": self.index, "samples": self.samples, "final": final},
                     self.ctx.secret, blobs=self._vector_message(self.node.flat.state.detach().cpu(), final),
                     timeout=2 * self.spec.peer_timeout + 5, sender=self.ctx.id, max_bytes=self.ctx.max_message_bytes)
        if final:
            self._final_sent_to = leader
        return reply

    def _address(self, index: int) -> str:
        return self.spec.peers[index].address

    def _mark_dead(self, index: int) -> None:
        with self._lock:
            if index not in self.dead:
                log.warning("task %s: provider %s is gone", self.spec.task_id, self.ids[index])
                self.dead.add(index)
                if self.leader_state is not None:
                    self.leader_state.mark_lost(index)

    def _alive(self, index: int) -> bool:
        try:
            call(self._address(index), "agg.ping", {"task": self.spec.task_id, "index": self.index},
                 self.ctx.secret, timeout=min(3.0, self.spec.peer_timeout / 2), sender=self.ctx.id)
            return True
        except (Unreachable, RemoteError):
            return False

    def _resolve_leader(self) -> int:
        """The lowest-indexed provider still alive (pinging those below this one not yet known dead)."""
        with self._lock:
            for i in range(len(self.ids)):
                if i in self.dead:
                    continue
                if i == self.index or self._alive(i):
                    self.leader = i
                    return i
                self._mark_dead(i)
            raise AssertionError("unreachable: this provider is alive")

    def _watch_leader(self) -> None:
        """Ping the leader while training, so it knows this provider lives and this one knows it does."""
        interval = max(0.2, self.spec.peer_timeout / 4)
        while not self._stop_pinging.wait(interval):
            leader = self.leader
            if leader != self.index and not self._alive(leader):
                self._mark_dead(leader)
                self._resolve_leader()

    # ---- the end --------------------------------------------------------------------------

    def _finish(self) -> None:
        flat = self.node.flat
        while not self.results_ready.is_set():
            leader = self._resolve_leader()
            if leader == self.index:
                state = self._lead()
                if not state.has_final(self.index):
                    state.submit(self.index, flat.state, self.samples, final=True)
                self._publish(state.wait_for_finals(), state)
                return
            if self._final_sent_to != leader:
                try:
                    self._push(leader, final=True)
                except Unreachable:
                    self._mark_dead(leader)
                    continue
                except RemoteError:
                    time.sleep(0.5)
                    continue
            while not self.results_ready.wait(0.5):
                if not self._alive(leader):
                    self._mark_dead(leader)
                    break

    def _publish(self, average: torch.Tensor, state: LeaderState) -> None:
        """Evaluate the final average, keep the result, and copy it to every living provider."""
        node = self.node
        node.flat.state.copy_(average)
        evaluation = evaluate_model(node.model, node.dataset, node.device, self.spec.eval_samples, full=True)
        contributions = state.report(self.ids)
        metrics = {
            "task": self.spec.task_id, "algorithm": self.spec.algorithm, "model": self.spec.model,
            "epochs": self.spec.epochs, "batch_size": self.spec.batch_size, "lr": self.spec.lr,
            "test_samples": self.spec.eval_samples or len(node.dataset.test_y),
            "loss": evaluation.loss, "accuracy": evaluation.accuracy, "precision": evaluation.precision,
            "recall": evaluation.recall, "f1": evaluation.f1, "confusion": evaluation.confusion,
            "class_names": list(node.dataset.class_names),
            "training_time": time.monotonic() - self._started_at,
            "leader": self.ctx.id, "leaders_lost": [self.ids[i] for i in sorted(self.dead) if i < self.index],
            "providers": contributions,
            "lost": sorted(pid for pid, c in contributions.items() if c["status"] == "lost"),
        }
        model_bytes = save_safetensors({k: v.detach().cpu().contiguous() for k, v in node.model.state_dict().items()})
        self._keep(metrics, model_bytes)
        for i in range(len(self.ids)):
            if i != self.index and i not in self.dead and contributions.get(self.ids[i], {}).get("status") != "lost":
                try:
                    call(self._address(i), "agg.results", {"task": self.spec.task_id, "metrics": metrics},
                         self.ctx.secret, blobs=[model_bytes], timeout=10, sender=self.ctx.id,
                         max_bytes=self.ctx.max_message_bytes)
                except (Unreachable, RemoteError) as exc:
                    log.warning("task %s: result not copied to %s: %s", self.spec.task_id, self.ids[i], exc)

    def _keep(self, metrics: dict, model_bytes: bytes) -> None:
        write_results(self.folder / "result", metrics, model_bytes)
        self.results_ready.set()

    # ---- answering peers and the requester --------------------------------------------------

    def start(self, book: dict[int, str]) -> None:
        """The requester's go: every provider is ready; ``book`` holds the engine addresses."""
        self._book = {j: a for j, a in book.items() if j != self.index and self.spec.algorithm != "leader"}
        self._start.set()

    def on_push(self, req: Envelope) -> tuple[dict, list]:
        index = field_of(req.body, "index", int, min_value=0)
        if index >= len(self.ids) or index == self.index:
            raise BadMessage(f"provider index {index} is not another provider of this task")
        if self.node is None or self.state in ("preparing", "failed"):
            raise BadMessage(f"{self.ctx.id} is not ready for models (state {self.state})")
        if self._resolve_leader() != self.index:
            raise BadMessage(f"{self.ctx.id} is not the leader: {self.ids[self.leader]} is")
        vector = self._vector_of(req.blobs)
        state = self._lead()
        average = state.submit(index, vector, field_of(req.body, "samples", int, min_value=0),
                               field_of(req.body, "final", bool, False))
        return {"cycle_of": index}, self._vector_message(average, False)

    def on_ping(self, req: Envelope) -> dict:
        index = field_of(req.body, "index", int, min_value=0)
        if self.leader_state is not None and index < len(self.ids):
            self.leader_state.touch(index)
        return {"state": self.state}

    def on_results(self, req: Envelope) -> dict:
        """A copy of the final result from the leader: checked against this task's model, then kept."""
        metrics = field_of(req.body, "metrics", dict, max_len=1_000_000)
        if len(req.blobs) != 1:
            raise BadMessage("a result carries exactly one model")
        try:
            tensors = load_safetensors(bytes(req.blobs[0]))
        except Exception:
            raise BadMessage("the result's model is not a valid safetensors file") from None
        mine = self.node.model.state_dict() if self.node is not None else {}
        if mine and ({k: tuple(v.shape) for k, v in tensors.items()} != {k: tuple(v.shape) for k, v in mine.items()}):
            raise BadMessage("the result's model does not match this task's model")
        self._keep(json.loads(json.dumps(metrics)), bytes(req.blobs[0]))
        return {"kept": True}

    def status(self) -> dict:
        return {"task": self.spec.task_id, "index": self.index, "state": self.state, "error": self.error,
                "engine": self.engine_address, "progress": self.progress, "leader": self.ids[self.leader],
                "results": self.results_ready.is_set()}
