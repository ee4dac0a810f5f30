"""A training task: the requester's validated request, and the spec every provider of it receives."""

from __future__ import annotations

import math
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from meshlearn.aggregation.spec import check_rule
from meshlearn.config import ExperimentConfig
from meshlearn.data.specs import DATASETS, KINDS, parse_spec
from meshlearn.definitions.base import DEFINITIONS, definition, names_that
from meshlearn.definitions.settings import LeaderSettings
from meshlearn.errors import BadMessage, ConfigError, UserInputError
from meshlearn.netem import parse_rate
from meshlearn.privacy.mechanism import active_mechanisms
from meshlearn.settings import Settings
from meshlearn.training import TrainingSettings
from meshlearn.transport.settings import TcpSettings, UdpSettings

MAX_EPOCHS = 1000
DEFAULT_LR = 0.001  # what a learning rate <= 0 becomes
SANE_LR = (1e-6, 10.0)  # a learning rate outside this range is taken, with a warning (CloudMesh report 4.5.2)
MAX_TASK_PEERS = 256
MAX_PEER_TIMEOUT = 3600.0
MAX_WAIT = 86400.0  # the longest a requester waits for providers (a day)
UDP_TIMEOUT = 2.0  # seconds a UDP task's provider waits for an iteration's datagrams (internet round trips)
# The rate, in Mbit/s, a UDP task's providers pace their datagrams at unless the requester says
# (--udp-rate). Datagrams sent faster than the slowest link of their path pile up in its router's
# small queue and are lost there; a home uplink commonly carries tens of Mbit/s, so a task paces
# for one rather than flooding it (a LAN or data centre asks --udp-rate 1gbit). Simulations on one
# machine keep UdpSettings' own rate_gbps, in effect unpaced.
UDP_RATE = 50.0
# The rates, in Mbit/s, a task may ask (providers refuse others): below, a model of a few MB takes
# most of a minute to leave; above, 10 Gbit/s is more than any provider's link carries
UDP_RATE_RANGE = (1.0, 10_000.0)
MBIT_PER_GBIT = 1000.0
WEIGHTS_FILE = "initial.safetensors"  # the name initial weights are served under
BUILT_IN_DATA = ("digits", "pystdlib")  # dataset specs without a path


def _network_default(name: str, default: Any, description: str) -> Any:
    """``TrainingSettings``' field ``name`` (type and bounds) with the network's own default and words."""
    return FieldInfo.merge_field_infos(TrainingSettings.model_fields[name], default=default, description=description)


class TaskSettings(TrainingSettings):
    """A network task's training (``TrainingSettings``, with the defaults the CloudMesh report's
    requests use) and its schedule across providers: what a request asks and its spec carries, and
    what a resumed task must train as before. The request and the spec compose it, so a field here
    travels from ``request``'s flags to every provider with nothing copied by hand."""

    model: str = _network_default("model", "simplecnn", "model: mlp | lenet | simplecnn | resnet18 | gpt-tiny | "
                                  "gpt-small (text), or one registered by --models-module")
    batch_size: int = _network_default("batch_size", 16, "mini-batch size (one outside 1..the training set's size "
                                       "becomes 16, with a warning: the CloudMesh report's correction)")
    lr: float = _network_default("lr", 0.01, f"learning rate (one <= 0 becomes {DEFAULT_LR}, with a warning: the "
                                 "CloudMesh report's correction)")
    algorithm: str = _network_default("algorithm", "leader", "how providers combine models: leader (asynchronous; "
                                      "--leader-sync true: synchronous cycles), dpsgd, gossip, or fedavg (the "
                                      "synchronous leader, with --fedavg-fraction)")
    epochs: int = Field(10, ge=1, le=MAX_EPOCHS, description="epochs over each provider's partition (as the "
                        f"CloudMesh report asks, a value outside 1..{MAX_EPOCHS} or not whole is corrected with a "
                        "warning, not refused)")
    aggregate_every: int | Literal["epoch"] = Field("epoch", description="aggregate every N batches, or 'epoch'")
    eval_every: int = Field(0, ge=0, description="evaluate on every provider every N iterations, for live accuracy "
                            "curves (bootstrap dashboard, --tensorboard); 0: only the final model")
    peer_timeout: float = Field(20.0, gt=0, le=MAX_PEER_TIMEOUT,
                                description="seconds of silence before a provider counts as gone")
    udp_timeout: float = Field(UDP_TIMEOUT, gt=0, le=MAX_PEER_TIMEOUT,
                               description="transport udp: seconds a provider waits for its peers' datagrams of an "
                                           "iteration before it averages what came")
    udp_rate: float = Field(UDP_RATE, ge=UDP_RATE_RANGE[0], le=UDP_RATE_RANGE[1],
                            description="transport udp: the rate each provider sends its datagrams at, to all its "
                                        "peers together, in Mbit/s or with a unit (10mbit, 1gbit); faster than the "
                                        "slowest provider's uplink, they are lost in its router's queue: set it a "
                                        f"little under that uplink ({UDP_RATE_RANGE[0]:g}..{UDP_RATE_RANGE[1]:g})")
    checkpoint_every: int | None = Field(None, ge=0, le=1_000_000, description="cycles between the checkpoints each "
                                         "provider sends the requester, which keeps the task's state for request "
                                         "--resume; 0: none (default: one an epoch)")

    _valid_aggregation = field_validator("aggregation")(classmethod(lambda cls, value: check_rule(value)))
    _valid_udp_rate = field_validator("udp_rate", mode="before")(classmethod(lambda cls, value: udp_rate_mbit(value)))
    _valid_algorithm = field_validator("algorithm")(classmethod(lambda cls, value: network_algorithm(value)))
    _valid_transport = model_validator(mode="after")(lambda self: transport_fits(self))
    _valid_outer = model_validator(mode="after")(lambda self: outer_fits(self))
    _valid_for_algorithm = model_validator(mode="after")(lambda self: definition_fits(self))
    _valid_fedavg = model_validator(mode="after")(lambda self: fedavg_fits(self))


class TaskRequest(TaskSettings):
    """What a requester asks of the network (``meshlearn request``: its flags, or the keys of a
    ``--config`` task file), after the corrections ``validate_request`` allows."""

    data: str = Field("", description="folder with train/ and test/, CIFAR-10's archive, or a dataset spec "
                                      "(digits, cifar10:PATH, ...; text: pystdlib, text:PATH)")
    data_on_providers: str | None = Field(None, description="dataset each provider already holds, under its "
                                                            "--data-root")
    providers: int = Field(4, ge=1, le=MAX_TASK_PEERS, description="providers to train on")
    min_providers: int | None = Field(None, ge=1, le=MAX_TASK_PEERS, description="start with this many, and take "
                                      "in more as they come free while the task runs, up to --providers (the data "
                                      "is split for --providers; algorithms leader, fedavg, gossip, dpsgd) (default: "
                                      "--providers, all at the start)")
    wait: float = Field(30.0, ge=0, le=MAX_WAIT, description="seconds to wait for as many free providers as asked, "
                        "saying what it waits for; then it takes those free (at least one); 0: take them at once")
    device: Literal["any", "gpu", "cuda", "mps", "cpu"] = Field("any", description="only providers of this device "
                                                                "(gpu is cuda); any: the device most free providers "
                                                                "declare, others after")
    device_fallback: bool = Field(False, description="when too few providers of --device are free, take others "
                                  "too, and say which")
    min_ram: float | None = Field(None, ge=0, description="only providers declaring at least this many GB of RAM "
                                  "(a provider declaring less than the task's estimated memory is always skipped)")
    min_cores: int | None = Field(None, ge=1, description="only providers declaring at least this many cores")
    prefer: Literal["any", "nearest"] = Field("any", description="nearest: ping the free candidates (3 round trips "
                                              "each, over the encrypted channel) and take those with the lowest "
                                              "round-trip time (CloudMesh report 4.3); any: the bootstrap's order")
    location: str | None = Field(None, max_length=64, description="only providers declaring this location")
    weights: str | None = Field(None, description="safetensors file of initial weights for the model "
                                                  "(default: a fresh model from the seed)")
    warnings: list[str] = Field(default_factory=list, description="corrections made to what was asked")

    _valid_joining = model_validator(mode="after")(lambda self: joining_fits(self))
    _valid_secure = model_validator(mode="after")(lambda self: privacy_fits(self, len_peers=self.providers,
                                                                           joins=self.min_providers is not None
                                                                           and self.min_providers < self.providers))


JOINABLE = ("leader", "fedavg", "gossip", "dpsgd")  # the algorithms whose groups take in members as they train


def joining_fits(request: "TaskRequest") -> "TaskRequest":
    """``request`` if providers may join it as it runs (``min_providers``) as its algorithm allows;
    else ValueError in one line."""
    if request.min_providers is None or request.min_providers >= request.providers:
        return request
    if request.algorithm not in JOINABLE:
        raise ValueError(f"--min-providers (providers joining a running task) is built for {', '.join(JOINABLE)}, "
                         f"not {request.algorithm}: use one of those, or leave --min-providers out")
    if request.algorithm == "dpsgd" and (request.transport != "tcp" or request.aggregation != "mean"):
        raise ValueError("--min-providers with dpsgd takes --transport tcp and --aggregation mean (every provider "
                         "takes a newcomer in at one round, over TCP, into the plain average): use those, or leave "
                         "--min-providers out")
    return request


def dataset_spec(data: str) -> str:
    """A dataset spec from ``--data``: a spec meshlearn knows (its path checked: a missing one is one
    line, before any network step), a folder with train/ and test/, or CIFAR's archive."""
    name, colon, _ = data.partition(":")
    if data in BUILT_IN_DATA or (colon and (name.strip().lower() in KINDS or name in DATASETS)):
        parse_spec(data)
        return data
    path = Path(data)
    if path.is_dir() and (path / "train").is_dir() and (path / "test").is_dir():
        return f"imagefolder:{path.resolve()}"
    if path.is_file() and path.name.startswith("cifar") and path.name.endswith((".tar.gz", ".tgz")):
        return f"cifar10:{path.resolve()}"
    if path.is_dir() and (path / "data_batch_1").exists():
        return f"cifar10:{path.resolve()}"
    if not path.exists():
        raise UserInputError(f"data path {data} does not exist: give a folder with train/ and test/, "
                             "or a dataset such as digits or cifar10:PATH")
    raise UserInputError(f"data path {data} holds no train/ and test/ folders: give an ImageFolder tree "
                         "(train/<class>/*, test/<class>/*) or a dataset such as digits")


def validate_request(values: dict[str, Any], train_samples: int | None = None) -> TaskRequest:
    """Check and correct a request before anything starts; corrections are listed in ``warnings``.

    Batch size outside [1, n] becomes the default, a learning rate <= 0 becomes 0.001 (one outside
    SANE_LR is kept, with a warning), epochs are rounded and clipped to 1..MAX_EPOCHS. Anything
    that cannot be corrected raises UserInputError.
    """
    defaults = {name: field.default for name, field in TaskRequest.model_fields.items()}
    values = {k: v for k, v in values.items() if v is not None}
    values["data"] = str(values.get("data") or values.get("data_on_providers") or "")
    if not values["data"]:
        raise UserInputError("no data: pass --data PATH (a folder with train/ and test/), a dataset such as "
                             "digits, or --data-on-providers SPEC")
    warnings: list[str] = []
    if values.get("weights"):
        values["weights"] = check_weights_file(str(values["weights"]))
    for key in ("seed", "providers", "eval_samples"):
        if key in values:
            values[key] = _integer(values[key], key.replace("_", " "), minimum=0 if key != "providers" else 1)

    epochs = _number(values.get("epochs", defaults["epochs"]), "epochs")
    if not math.isfinite(epochs):
        raise UserInputError("epochs must be a finite number")
    rounded = min(MAX_EPOCHS, max(1, round(epochs)))
    if rounded != epochs:
        warnings.append(f"epochs {epochs:g} became {rounded} (a whole number in 1..{MAX_EPOCHS})")
    values["epochs"] = rounded

    batch = _number(values.get("batch_size", defaults["batch_size"]), "batch size")
    upper = train_samples if train_samples else math.inf
    if batch != int(batch) or not 1 <= batch <= upper:
        warnings.append(f"batch size {batch:g} is outside [1, {upper}]: using {defaults['batch_size']}")
        batch = defaults["batch_size"]
    values["batch_size"] = int(batch)

    lr = _number(values.get("lr", defaults["lr"]), "learning rate")
    if not lr > 0 or not math.isfinite(lr):
        warnings.append(f"learning rate {lr:g} must be more than 0: using {DEFAULT_LR}")
        lr = DEFAULT_LR
    elif not SANE_LR[0] <= lr <= SANE_LR[1]:
        warnings.append(f"learning rate {lr:g} is outside [{SANE_LR[0]:g}, {SANE_LR[1]:g}]: "
                        + ("training will likely diverge (loss nan)" if lr > SANE_LR[1]
                           else "training will barely move the model"))
    values["lr"] = lr

    every = values.get("aggregate_every", "epoch")
    values["aggregate_every"] = "epoch" if str(every) == "epoch" else \
        _integer(every, "aggregate-every (a number of batches, or epoch)", minimum=1)
    return TaskRequest(**values, warnings=warnings)


def check_weights_file(path: str) -> str:
    """The absolute path of a readable safetensors file of tensors; UserInputError says what is wrong."""
    from safetensors import SafetensorError, safe_open

    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"weights file {path} does not exist: give a .safetensors file of the model's state")
    try:
        with safe_open(str(file), framework="pt") as handle:
            if not list(handle.keys()):
                raise UserInputError(f"weights file {path} holds no tensors")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserInputError(f"weights file {path} is not a safetensors file ({exc}): save it with "
                             "safetensors.torch.save_file(model.state_dict(), PATH)") from None
    return str(file.resolve())


def _number(value: Any, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserInputError(f"{what} {value!r} is not a number") from None


def _integer(value: Any, what: str, minimum: int) -> int:
    number = _number(value, what)
    if number != int(number) or number < minimum:
        raise UserInputError(f"{what} must be a whole number of at least {minimum} (got {value!r})")
    return int(number)


def new_task_id() -> str:
    return uuid.uuid4().hex[:12]


class Peer(Settings):
    """A provider of the task, in leader-election order (index 0 leads first)."""

    id: str = Field(max_length=64)
    address: str = Field(max_length=256)
    shard: int | None = Field(None, ge=0, lt=MAX_TASK_PEERS)  # the data shard it trains on (None: its index);
    # another's where it took the place of a provider the task lost


class ServedFile(Settings):
    """A file the requester serves (initial weights): where to fetch it, its size and SHA-256."""

    address: str = Field(max_length=256)
    size: int = Field(ge=1, le=1 << 36)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class Resumed(Settings):
    """Where a resumed task goes on from: per provider index, the cycle of its checkpoint the
    requester kept, and where it serves them (``provider-I.json`` and ``provider-I.safetensors``)."""

    cycles: list[int] = Field(min_length=1, max_length=MAX_TASK_PEERS)
    address: str = Field(max_length=256)
    files: dict[str, dict[str, Any]] = Field(max_length=2 * MAX_TASK_PEERS)

    @field_validator("cycles")
    @classmethod
    def _positive(cls, cycles: list[int]) -> list[int]:
        if any(cycle < 1 for cycle in cycles):
            raise ValueError("a resumed provider's cycle is at least 1")
        return cycles


def transport_fits(task: "TaskRequest | TaskSpec") -> "TaskRequest | TaskSpec":
    """``task`` if its algorithm runs over its transport (by the algorithm's declaration); else
    ValueError in one line."""
    if task.transport == "udp" and task.algorithm in DEFINITIONS and not definition(task.algorithm).needs.lossy:
        raise ValueError(f"transport udp carries algorithms that average around lost datagrams (dpsgd); "
                         f"{task.algorithm} needs transport tcp")
    return task


def outer_fits(task: "TaskRequest | TaskSpec") -> "TaskRequest | TaskSpec":
    """``task`` if its algorithm takes its outer optimizer (fedavg, dpsgd, gossip, the leader's
    synchronous cycles: each provider steps after each of its iterations); else ValueError in one line."""
    takes = task.algorithm in DEFINITIONS and definition(task.algorithm).needs.outer
    if task.outer.active and not takes:
        raise ValueError(f"outer {task.outer.spec} needs aggregations every provider takes at once: use "
                         "algorithm fedavg, dpsgd or gossip, or leader with --leader-sync true")
    return task


def definition_fits(task: "TaskRequest | TaskSpec") -> "TaskRequest | TaskSpec":
    """``task`` unless its algorithm's own checks (``Definition.conflict``) refuse the rest of it;
    else ValueError in one line."""
    problem = definition(task.algorithm).conflict(task) if task.algorithm in DEFINITIONS else None
    if problem:
        raise ValueError(problem)
    return task


def fedavg_fits(task: "TaskRequest | TaskSpec") -> "TaskRequest | TaskSpec":
    """``task`` unless it asks FedAvg for quantized changes, fragments or overlapped exchanges, which
    a network task's FedAvg (the synchronous leader) does not do; else ValueError in one line."""
    fedavg = task.fedavg
    if fedavg.compress != "none" or fedavg.fragments > 1 or fedavg.overlap:
        raise ValueError("--fedavg-compress, --fedavg-fragments and --fedavg-overlap run in simulations (meshlearn "
                         "simulate, experiment) only: a network task's FedAvg is the synchronous leader, which sends "
                         "whole models in turn; drop them")
    return task


def privacy_fits(task: "TaskRequest | TaskSpec", len_peers: int, joins: bool) -> "TaskRequest | TaskSpec":
    """``task`` unless a privacy mechanism it asks for cannot run with the rest of it (each active
    mechanism's ``task_conflicts``: for secure aggregation and central DP an algorithm other than
    fedavg or the synchronous leader, a robust rule; for secure aggregation also fewer than 3
    providers, or providers joining as it runs); else ValueError in one line."""
    for mechanism in active_mechanisms(task, loaded=False):  # a provider refuses a name it has not loaded
        asked, left_out = mechanism.flag
        for lacking, need in mechanism.task_conflicts(task, len_peers, joins):
            if lacking:
                raise ValueError(f"{asked} needs {need}; or leave {left_out} out")
    return task


def udp_rate_mbit(value: Any) -> float:
    """A task's UDP rate in Mbit/s, from a bandwidth in tc's units (``10mbit``, ``1gbit``) or a
    number of Mbit/s; ValueError in one line for anything else, or a rate outside ``UDP_RATE_RANGE``."""
    low, high = UDP_RATE_RANGE
    problem = f"{value!r} is not a rate: give one like 50mbit or 1gbit, or a number of Mbit/s"
    number_or_text = isinstance(value, (str, int, float)) and not isinstance(value, bool)
    text = str(value).strip().lower() if number_or_text else ""  # "": not a rate
    try:
        mbit = parse_rate(text) / 1e6 if text.endswith("bit") else float(text)
    except ValueError:
        raise ValueError(problem) from None
    if not math.isfinite(mbit):
        raise ValueError(problem)
    if not low <= mbit <= high:
        raise ValueError(f"{mbit:g} Mbit/s is outside the {low:g}..{high:g} Mbit/s ({low:g}mbit.."
                         f"{high / MBIT_PER_GBIT:g}gbit) a task may ask")
    return mbit


def network_algorithm(name: str) -> str:
    """``name`` if its algorithm's declaration lets it run as a network task; else ValueError
    naming those that can. (A name only selects a registered algorithm: nothing is imported by it.)"""
    name = name.strip()
    if name not in DEFINITIONS or not definition(name).needs.network:
        raise ValueError(f"algorithm {name!r} does not run as a network task: choose one of "
                         f"{', '.join(names_that(lambda needs: needs.network))}")
    return name


class TaskSpec(TaskSettings):
    """Everything a provider needs to run its part of a task; sent as JSON, validated on arrival."""

    task_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    peers: list[Peer] = Field(min_length=1, max_length=MAX_TASK_PEERS)
    data: dict[str, Any]  # {"mode": "served", "address", "files"} or {"mode": "local", "dataset"}
    meta: dict[str, Any] | None = None  # classes and normalization (served mode)
    weights: ServedFile | None = None  # initial weights, served by the requester
    requester: str = Field("", max_length=256)
    slots: int = Field(0, ge=0, le=MAX_TASK_PEERS)  # the shards the data is split into (0: one per peer); more than
    # the peers: providers may join while it runs, each taking the next slot
    joining: bool = False  # the spec a newcomer gets: it joins the task's providers as they train
    checkpoints_to: str = Field("", max_length=256)  # where providers send their checkpoints (the requester)
    resume: Resumed | None = None  # a task resumed from the checkpoints the requester kept

    _valid_secure = model_validator(mode="after")(
        lambda self: privacy_fits(self, len(self.peers), self.joining or self.slots > len(self.peers)))

    def settings(self) -> dict:
        """The task's training settings as plain data (no data or weights addresses): its task.yaml."""
        return self.model_dump(mode="json", exclude={"data", "meta", "weights", "checkpoints_to", "resume"})

    def fingerprint(self) -> str:
        """What makes two attempts of a task the same training (not who runs it, from where, or how
        fast it sends), as a digest each checkpoint records: a task resumes only from its own."""
        import hashlib
        import json

        kept = self.model_dump(mode="json", exclude={"data", "weights", "checkpoints_to", "resume", "peers",
                                                     "requester", "peer_timeout", "udp_rate", "slots", "joining"})
        kept["providers"] = self.shards
        return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def shards(self) -> int:
        """The shards the task's data is split into: one per slot (the most providers it takes at
        once; a provider in a lost one's place takes its shard), else one per provider."""
        return self.slots or len(self.peers)

    def shard_of(self, index: int) -> int:
        """The data shard provider ``index`` trains on (BadMessage where the spec names none)."""
        shard = self.peers[index].shard
        shard = index if shard is None else shard
        if shard >= self.shards:
            raise BadMessage(f"task {self.task_id}: provider {index} has no shard (shard {shard} of {self.shards})")
        return shard

    def checkpoint_interval(self, cycles: int) -> int:
        """Cycles between two checkpoints of a provider running ``cycles`` (0: none)."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return max(1, math.ceil(cycles / self.epochs))

    @classmethod
    def parse(cls, body: dict) -> "TaskSpec":
        """Validate a spec from the network; BadMessage names the first problem."""
        if not isinstance(body, dict):
            raise BadMessage("task spec is not a JSON object of settings")
        try:
            return cls(**{str(k): v for k, v in body.items()})
        except ConfigError as exc:
            raise BadMessage(f"task spec: {exc}") from None

    def schedule(self, samples: int) -> tuple[int, int]:
        """(local steps per aggregation cycle, cycles) for a provider holding ``samples`` samples."""
        batches_per_epoch = math.ceil(samples / min(self.batch_size, samples))
        every = batches_per_epoch if self.aggregate_every == "epoch" else self.aggregate_every
        return every, math.ceil(self.epochs * batches_per_epoch / every)

    def experiment_config(self, samples: int, host: str, device: str, max_message_mb: float) -> ExperimentConfig:
        """The engine's configuration for one provider's part: the task's algorithm over a full
        graph of the task's providers (local training when there is only one), with the peer
        timeout as every deadline's base. FedAvg runs as the synchronous leader (``engine_algorithm``)."""
        rounds, iterations = self.schedule(samples)
        alone = self.shards == 1  # one provider has no one to exchange with
        algorithm, leader = self.engine_algorithm()
        training = self.fields_of(TrainingSettings)
        del training["vocabulary"]  # the data's own: taskdata loads it (from shards, or locally), not a dataset spec
        return ExperimentConfig(
            **{**training, "algorithm": "local" if alone else algorithm, "leader": leader,
               "transport": "tcp" if alone else self.transport},
            nodes=max(2, self.shards, len(self.peers)), topology="full", rounds=rounds, iterations=iterations,
            test_after=min(self.eval_every or iterations, iterations), eval_nodes=0 if self.eval_every else 1,
            host=host, device=device,
            tcp=TcpSettings(wait_timeout=self.peer_timeout, handshake_timeout=self.handshake_timeout,
                            max_message_mb=max_message_mb),
            udp=UdpSettings(timeout=self.udp_timeout, rate_gbps=self.udp_rate / MBIT_PER_GBIT,
                            handshake_timeout=self.handshake_timeout, max_message_mb=max_message_mb),
            checkpoint_every=self.checkpoint_interval(iterations) if self.checkpoints_to else 0)

    @property
    def handshake_timeout(self) -> float:
        """Seconds a provider's engine waits for its neighbours' handshakes (three peer timeouts)."""
        return 3 * self.peer_timeout

    def engine_algorithm(self) -> tuple[str, LeaderSettings]:
        """The engine's algorithm and leader settings for the task's algorithm. FedAvg in the network
        is the leader, synchronous, weighing by samples, its aggregate taking the fraction's members
        each cycle: its server is the leader, so it fails over as the leader does (the engine's
        ``fedavg``, node 0 the server for good, is the simulator's baseline)."""
        if self.algorithm != "fedavg":
            return self.algorithm, self.leader
        central = self.leader.central_dp
        return "leader", LeaderSettings(first_barrier=True, weighting="equal" if central.active else "samples",
                                        sync=True, fraction=self.fedavg.fraction, secure=self.leader.secure,
                                        central_dp=central)
