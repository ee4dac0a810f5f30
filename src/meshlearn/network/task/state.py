"""A task's state kept for resuming it: each provider's checkpoints, sent to the requester, and the
requester's record of the task (``task.json``), so that a task whose every process died goes on
from its last checkpoint (``meshlearn request --resume TASK_ID``).

A provider keeps its checkpoint in its task folder (``checkpoint``'s safetensors + JSON), then
sends both files to the requester over the task's encrypted channel (``task.checkpoint``). The
requester takes a checkpoint only from the provider it names, checks it whole (format, checksum,
the task's fingerprint) before writing it, and keeps the newest two per position: a data shard,
whose checkpoints go by ``provider-I`` (I: the shard), written by the provider that holds it (one
taken in at a lost provider's place holds that one's). A resumed task serves them back to the
providers it claims, provider I its ``provider-I`` pair.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from meshlearn.checkpoint import FOLDER, CheckpointStore, RunCheckpoints
from meshlearn.errors import CheckpointError
from meshlearn.network.channel.envelope import BadMessage, NetworkError
from meshlearn.network.task.spec import MAX_TASK_PEERS, TaskRequest, TaskSpec

if TYPE_CHECKING:
    from meshlearn.network.task.datashare import FetchChunk

log = logging.getLogger(__name__)

RECORD = "task.json"  # the requester's record of a task, in its results folder
CHECKPOINT_TIMEOUT = 120.0  # seconds a provider gives the requester to take one checkpoint


def checkpoint_name(index: int) -> str:
    """The name provider ``index``'s checkpoints go by (on the provider; at the requester, those of
    position ``index``)."""
    return f"provider-{index}"


def holders(spec: TaskSpec) -> dict[int, int]:
    """Who holds each position of ``spec``: data shard -> the index of the provider training on it
    (one taken in at a lost provider's place, later in ``peers``, holds that one's)."""
    return {spec.shard_of(index): index for index in range(len(spec.peers))}


# How a provider sends the requester its checkpoint of a cycle: (cycle, [its JSON, its tensors]);
# raises NetworkError. The provider builds it (``task.checkpoint``, typed).
SendCheckpoint = Callable[[int, list[bytes]], None]


class SentCheckpoints(RunCheckpoints):
    """A provider's checkpoints of its part of a task: kept in its task folder and each sent to the
    requester with ``send`` (None: kept only; a failed send is logged, and training goes on)."""

    def __init__(self, folder: Path, index: int, spec: TaskSpec, send: SendCheckpoint | None):
        super().__init__(folder, checkpoint_name(index), spec.fingerprint())
        self.index, self.task, self.send = index, spec.task_id, send
        self.sent = 0  # checkpoints the requester took

    def save(self, iteration: int, parts: dict[str, Any], **meta: Any) -> None:
        super().save(iteration, parts, **meta)
        if self.send is None:
            return
        folder = self.store.folder(iteration)
        files = [(folder / f"{self.name}{suffix}").read_bytes() for suffix in (".json", ".safetensors")]
        try:
            self.send(iteration, files)
            self.sent += 1
        except NetworkError as exc:
            log.warning("task %s: the requester did not take the checkpoint of cycle %d: %s", self.task, iteration,
                        exc)


def fetch_checkpoint(spec: TaskSpec, index: int, folder: Path, fetch_chunk: FetchChunk,
                     before_chunk: Callable[[], None] | None = None) -> None:
    """Download provider ``index``'s checkpoint of the cycle a resumed ``spec`` goes on from into
    its place in ``folder``'s checkpoints (``download`` with ``fetch_chunk``, from the requester's
    data server at ``spec.resume.address``: resumable, checksummed)."""
    from meshlearn.network.task.datashare import download

    resumed = spec.resume
    if index >= len(resumed.cycles):
        raise BadMessage(f"the resumed task names no checkpoint for provider {index}")
    name = checkpoint_name(index)
    target = CheckpointStore(folder / FOLDER).folder(resumed.cycles[index])
    for suffix in (".safetensors", ".json"):  # the JSON last: it says the pair is whole
        file = f"{name}{suffix}"
        if file not in resumed.files:
            raise BadMessage(f"the resumed task serves no {file}")
        download(fetch_chunk, file, resumed.files[file], target, source=resumed.address, before_chunk=before_chunk)


def secret_digest(secret: bytes, task_id: str) -> str:
    """What ``task.json`` keeps of the network's secret: a keyed digest, enough to tell that a
    resume uses the secret the task ran on, and nothing to recover it from."""
    return hmac.new(secret, f"meshlearn task {task_id}".encode(), hashlib.sha256).hexdigest()


@dataclass
class TaskRecord:
    """The requester's record of a task: its id, request, secret's digest, providers and status."""

    task_id: str
    request: TaskRequest
    secret: str
    status: str = "running"
    providers: list[str] | None = None  # the provider holding each position of the attempt under way, in order
    fingerprint: str = ""  # the started spec's (TaskSpec.fingerprint)

    def note(self, spec: TaskSpec) -> None:
        """Take in the attempt under way: the provider that holds each of its positions now (what a
        resume claims first, each for its own position; not one a newcomer took the place of) and
        its fingerprint."""
        held = holders(spec)
        self.providers = [spec.peers[held[shard]].id for shard in sorted(held)]
        self.fingerprint = spec.fingerprint()

    def write(self, folder: Path) -> None:
        """Write ``task.json`` into ``folder`` (whole or not at all)."""
        folder.mkdir(parents=True, exist_ok=True)
        data = {"task": self.task_id, "request": self.request.model_dump(mode="json"), "secret": self.secret,
                "status": self.status, "providers": self.providers, "fingerprint": self.fingerprint}
        partial = folder / f".{RECORD}.partial"
        partial.write_text(json.dumps(data, indent=1))
        os.replace(partial, folder / RECORD)

    @classmethod
    def read(cls, folder: Path) -> "TaskRecord":
        """The record in ``folder``; CheckpointError, in one line, if there is none or it is not one."""
        path = folder / RECORD
        try:
            data = json.loads(path.read_text())
            record = cls(str(data["task"]), TaskRequest(**data["request"]), str(data["secret"]),
                         str(data["status"]), _ids(data.get("providers")), str(data.get("fingerprint", "")))
        except FileNotFoundError:
            raise CheckpointError(f"{folder} holds no task ({RECORD} is missing): give the results folder of the "
                                  "task to resume (--output)") from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path} is not a task record meshlearn wrote ({exc})") from None
        if len(record.providers or []) > record.request.providers:
            raise CheckpointError(f"{path} names {len(record.providers)} providers for a task of at most "
                                  f"{record.request.providers}: an older meshlearn wrote it after a provider took a "
                                  "lost one's place, which it does not tell apart; request the task afresh")
        return record


def _ids(providers: Any) -> list[str] | None:
    """A record's providers as read (None: it names none yet); ValueError unless a list of ids."""
    if providers is not None and not (isinstance(providers, list) and all(isinstance(p, str) for p in providers)):
        raise ValueError("its providers are not a list of ids")
    return providers


def find_task(task_id: str, output: str | None) -> Path:
    """The results folder of task ``task_id``: ``output`` if given, else the one under ``runs/``
    whose record names it; CheckpointError if none does."""
    if output:
        return Path(output)
    for path in sorted(Path("runs").glob(f"*/{RECORD}")):
        try:
            if json.loads(path.read_text()).get("task") == task_id:
                return path.parent
        except (OSError, ValueError, AttributeError):
            continue
    raise CheckpointError(f"no folder under runs/ holds task {task_id}: give its results folder with --output")


class KeptCheckpoints:
    """The checkpoints a requester keeps of its task's providers (``folder``: its results folder),
    the newest two per position (``holders``)."""

    def __init__(self, folder: Path):
        self.store = CheckpointStore(Path(folder) / FOLDER, keep=2)

    def take(self, spec: TaskSpec | None, task: str, index: int, cycle: int, meta: bytes, tensors: bytes,
             check_caller: Callable[[int], None]) -> int:
        """Keep provider ``index``'s checkpoint of ``cycle`` of task ``task`` (its JSON ``meta`` and
        its ``tensors``), sent while ``spec`` runs, as its position's; returns the cycle kept.
        ``check_caller`` refuses a caller that is not provider ``index``. Kept only once whole, of
        this task and from the provider that holds its position now (BadMessage, in one line, where
        it is not)."""
        if spec is None:
            raise BadMessage("no task is running here to take a checkpoint of")
        if task != spec.task_id:
            raise BadMessage(f"this requester runs task {spec.task_id}, not that one")
        if index >= len(spec.peers) or index >= MAX_TASK_PEERS:
            raise BadMessage(f"task {spec.task_id} has no provider {index}")
        check_caller(index)
        position = _position(spec, index)
        try:
            self.store.put(cycle, checkpoint_name(position), meta, tensors, spec.fingerprint())
        except CheckpointError as exc:
            raise BadMessage(f"checkpoint of provider {index}, cycle {cycle}, refused: {exc}") from None
        return cycle

    def latest(self, providers: int) -> int | None:
        """The newest cycle every one of ``providers`` positions has a checkpoint of."""
        return self.store.latest([checkpoint_name(index) for index in range(providers)])

    def resume_cycles(self, providers: int, in_step: bool) -> list[int] | None:
        """The cycle each provider goes on from: ``in_step`` (a synchronous algorithm), the newest
        every one has a checkpoint of, where there is one; else each one's newest (asynchronous
        providers run at their own pace, often more than the two kept checkpoints apart). None
        where a provider has none."""
        common = self.latest(providers) if in_step else None
        if common is not None:
            return [common] * providers
        iterations = self.store.iterations()
        newest = []
        for index in range(providers):
            own = [cycle for cycle in iterations if self.store.has(cycle, checkpoint_name(index))]
            if not own:
                return None
            newest.append(own[-1])
        return newest

    def check(self, cycles: list[int], fingerprint: str) -> None:
        """CheckpointError, in one line, unless each provider's checkpoint of its cycle is whole and
        of the training ``fingerprint`` names."""
        for index, cycle in enumerate(cycles):
            meta, _ = self.store.load(cycle, checkpoint_name(index))
            if meta.get("fingerprint") != fingerprint:
                raise CheckpointError(f"the checkpoint of provider {index} at cycle {cycle} is of another training")

    def clear(self) -> None:
        """Remove every checkpoint kept (the task is done)."""
        self.store.clear()

    def files(self, cycles: list[int]) -> dict[str, Path]:
        """The files to serve a resumed task: name -> path, each provider's of its cycle."""
        return {f"{checkpoint_name(index)}{suffix}": self.store.folder(cycle) / f"{checkpoint_name(index)}{suffix}"
                for index, cycle in enumerate(cycles) for suffix in (".json", ".safetensors")}


def _position(spec: TaskSpec, index: int) -> int:
    """The position (data shard) whose checkpoints provider ``index`` of ``spec`` sends; BadMessage
    where a provider taken in at its place holds it now (its own are not the position's any more)."""
    shard = spec.shard_of(index)
    holder = holders(spec)[shard]
    if holder != index:
        raise BadMessage(f"provider {index} of task {spec.task_id} lost its place (shard {shard}) to provider "
                         f"{holder}: its checkpoints are not kept")
    return shard
