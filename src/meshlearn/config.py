"""The experiment configuration: the run's own settings, composed with every component's settings.

Each component owns its settings (defaults and documentation in one place): ``TcpSettings``,
``UdpSettings``, ``NetemSpec``, ``DpsgdSettings``, ``GossipSettings``, ``LeaderSettings``. An
experiment holds one section of each (``tcp:``, ``udp:``, ``net:``, ``dpsgd:``, ...). Files and
flags may also name a section's setting flat, by its flat name (``udp_mode: async`` is
``udp: {mode: async}``, ``wait_timeout: 30`` is ``tcp: {wait_timeout: 30}``); a flat name shared
by two transports (``handshake_timeout``, ``max_message_mb``) sets both. Flat names win over a
section given in the same file, so a flag overrides a file.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

from meshlearn.attacks.spec import BYZANTINE_HELP, parse_byzantine
from meshlearn.data.specs import IMAGE_KINDS, KINDS
from meshlearn.definitions.base import DEFINITIONS, definition, names_that
from meshlearn.definitions.mixing import MixingSettings, mixing_refusal
from meshlearn.definitions.needs import RunShape, accepts_sharing, refusal
from meshlearn.definitions.objective import OBJECTIVE_HELP, Objective, objective_refusal
from meshlearn.enginesettings import BatchedSettings
from meshlearn.errors import ConfigError, TopologyError, about
from meshlearn.netem import NetemSpec
from meshlearn.optim import parse_optimizer
from meshlearn.privacy.mechanism import active_mechanisms
from meshlearn.settings import Settings
from meshlearn.sharing.spec import SHARING_HELP, parse_sharing
from meshlearn.suggest import did_you_mean
from meshlearn.tasks.spec import TASK_HELP, TASKS
from meshlearn.topology.generators import ONE_PEER_EXPONENTIAL
from meshlearn.topology.sampling import SAMPLING_HELP, check_sampling
from meshlearn.training import ALGORITHM_SECTIONS, TrainingSettings, user_setting_fields
from meshlearn.transport.settings import TcpSettings, UdpSettings

if TYPE_CHECKING:
    from meshlearn.data import Dataset

# The sections a configuration holds: the transports', every algorithm's (named as it), the batched engine's
SECTIONS: dict[str, type[Settings]] = {
    "tcp": TcpSettings, "udp": UdpSettings,
    **{name: TrainingSettings.model_fields[name].annotation for name in ALGORITHM_SECTIONS},
    "mixing": MixingSettings, "batched": BatchedSettings,
}


def _flat_routes() -> dict[str, list[tuple[str, str]]]:
    """Flat name -> every (section, field) it sets."""
    routes: dict[str, list[tuple[str, str]]] = {}
    for section, cls in SECTIONS.items():
        for flat, name in cls.flat_names().items():
            routes.setdefault(flat, []).append((section, name))
    return routes


FLAT_ROUTES = _flat_routes()
DEFAULT_TOPOLOGY = "regular:3"


def default_topology(nodes: int) -> str:
    """The topology a run gets when it names none: 3-regular, or where no 3-regular graph on
    ``nodes`` nodes exists, the nearest that does (everyone with everyone under 4 nodes; 4-regular
    for an odd count)."""
    if nodes < 4:
        return "full"
    return DEFAULT_TOPOLOGY if nodes % 2 == 0 else "regular:4"
PROCESS_NODES = 4096  # node processes one machine may start


class ExperimentConfig(TrainingSettings):
    """One decentralized training run on one machine (or a provider's part of a network task): what
    trains and how (``TrainingSettings``), on how many nodes, which engine and graph, how they talk."""

    nodes: int = Field(8, ge=2, le=1_000_000, description="number of nodes (the process engine: at most 4096)")
    engine: Literal["process", "batched"] = Field(
        "process", description="process (one OS process per node, real sockets and timing) | batched (every node "
        "in one process, trained together, time modelled: thousands of nodes)")
    topology: str = Field(DEFAULT_TOPOLOGY, description="ring | torus | star | full | regular:D | smallworld:K:P | "
                          "erdos:P | one-peer-exponential (one peer per round, 1, 2, 4, ... places on) | file:PATH "
                          "(a DecentralizePy graph file); when none is given, regular:3 where it "
                          "exists, else full (under 4 nodes) or regular:4 (an odd node count)")
    peer_sampling: str = Field("off", description="dynamic topologies (dpsgd, pushsum; tracking and gtadam with graph only): " + SAMPLING_HELP)
    dataset: str = Field("digits", description="digits | fashion-mnist:DIR | mnist:DIR | cifar10:PATH | "
                                               "imagefolder:DIR | leaf:DIR (LEAF's per-writer JSON: FEMNIST, or "
                                               "Shakespeare's text) | pystdlib (text: the running Python's standard library) | text:PATH "
                                               "(a text file or a folder of .txt) | synthetic:ALPHA,BETA (the FedProx paper's "
                                               "synthetic data, generated: one user per node) | one registered by "
                                               "--models-module")
    models_module: str | None = Field(None, description="local .py file registering custom models and datasets "
                                      "(register_model, register_dataset), loaded by every node")
    task: str = Field("auto", description=TASK_HELP)  # after models_module: it may name a task registered there
    byzantine: str = Field("", description=BYZANTINE_HELP)
    sharing: str = Field("full", description="what a dpsgd node sends of its model: " + SHARING_HELP)
    net: NetemSpec = Field(NetemSpec(), description="emulated network, e.g. "
                                                      "loss=20%,corr=25%,delay=200ms,jitter=50ms,rate=10mbit "
                                                      "(rate: each link's bandwidth)")
    loss_mode: Literal["auto", "kernel", "user"] = Field(
        "auto", description="where net's loss is made: kernel (real drops in a network namespace; root + nftables), "
        "user (in the transport), auto (kernel for TCP where possible, user for UDP)")
    slowdown: str = Field("", description="emulated slow steps: RANK:FACTOR or RANK:+TIME, RANK may be *; "
                          "e.g. 0:3 (node 0 trains 3x slower) or *:+20ms,0:+60ms (sleep per step)")
    rounds: int = Field(1, ge=0, description="local SGD steps per iteration")
    full_epochs: bool = Field(False, description="rounds count passes over the node's shard, not mini-batches "
                              "(DecentralizePy's full_epochs)")
    iterations: int = Field(100, ge=1, description="iterations (rounds + one exchange each)")
    test_after: int = Field(10, ge=1, description="evaluate every this many iterations (and at the end)")
    eval_nodes: int = Field(0, ge=0, description="evaluate on the first N nodes only (0 = all)")
    train_evaluate: bool = Field(False, description="every evaluation also measures each node's loss and accuracy "
                                 "over its whole training shard (DecentralizePy's train_evaluate_after)")
    validation: float = Field(0.0, ge=0, lt=1, description="share of the test set held out as a validation set "
                              "(seeded, the same for every node): every evaluation also reports validation loss "
                              "and accuracy, and test metrics use the rest (0 = none)")
    topology_colour: Literal["accuracy", "lag"] = Field(
        "accuracy", description="what topology.png colours each node by: its final test accuracy, or its finish-time "
                                "lag (seconds it finished after the first node: whom slow nodes held back)")
    reshuffle: bool = Field(False, description="pool the dataset's train and test sets and split them again with "
                            "the seed (same sizes, stratified by class): an experiment's seeds then also vary "
                            "the split, and its spread shows in the report")
    host: str = Field("127.0.0.1", description="address nodes listen on")
    base_port: int = Field(0, ge=0, le=65535, description="node r listens on base_port + r (0 = any free port)")
    device: str = Field("cpu", description="torch device for training: cpu | cuda | cuda:N | mps")
    threads: int = Field(1, ge=1, description="torch intra-op threads per node process")
    output: str | None = Field(None, description="results folder (default: runs/<timestamp>; meshlearn "
                                 "node: runs/<address file name>)")
    checkpoint_every: int | None = Field(
        None, ge=0, description="keep the run's state every this many iterations, to continue it after a crash "
        "(simulate --resume FOLDER); 0: never (default: every test_after iterations, at most 20 times a run)")
    checkpoint_keep: int = Field(2, ge=1, le=1000, description="how many of the newest checkpoints a run keeps")
    tcp: TcpSettings = Field(TcpSettings(), description="the TCP transport (also carries gossip and leader)")
    udp: UdpSettings = Field(UdpSettings(), description="the UDP transport")
    objective: Objective = Field("nodes", description=OBJECTIVE_HELP)
    mixing: MixingSettings = Field(MixingSettings(), description="exchanges with the neighbours per iteration "
                                   "(multi-step and accelerated gossip)")
    batched: BatchedSettings = Field(BatchedSettings(), description="the batched engine")

    @model_validator(mode="before")
    @classmethod
    def _route_flat_names(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = dict(values)
        sections: dict[str, dict] = {}
        for flat in [key for key in values if key in FLAT_ROUTES and key not in cls.model_fields]:
            value = values.pop(flat)
            for section, name in FLAT_ROUTES[flat]:
                if section not in sections:
                    given = values.get(section) or {}
                    sections[section] = given.model_dump() if isinstance(given, Settings) else dict(given) \
                        if isinstance(given, dict) else given
                if isinstance(sections[section], dict):
                    sections[section][name] = value
        values.update(sections)
        if "topology" not in values and isinstance(values.get("nodes", 8), int):  # a default that fits the run
            values["topology"] = default_topology(values.get("nodes", 8))
        return values

    @field_validator("topology", "dataset", "host", "device")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @model_validator(mode="after")
    def _known_algorithm(self) -> "ExperimentConfig":
        if self.algorithm not in DEFINITIONS and not self.models_module:  # else checked once it has loaded
            raise ConfigError(f"{DEFINITIONS.unknown(self.algorithm)}, or register your own in a --models-module file",
                              setting="algorithm", value=self.algorithm)
        return self

    @model_validator(mode="after")
    def _vocabulary_fits(self) -> "ExperimentConfig":
        kind = KINDS.get(self.dataset.partition(":")[0].strip().lower(), ("",))[0]
        if self.vocabulary != "bytes" and kind in IMAGE_KINDS:
            raise ConfigError(f"vocabulary {self.vocabulary} is for text datasets (pystdlib, text:PATH, LEAF's "
                              f"Shakespeare); {self.dataset} holds images: leave vocabulary out")
        return self

    @model_validator(mode="after")
    def _privacy_fits(self) -> "ExperimentConfig":
        for mechanism in active_mechanisms(self, loaded=not self.models_module):  # DP-SGD, secure aggregation, central DP, a module's
            _require(*mechanism.asked, mechanism.conflicts(self))
        return self

    @model_validator(mode="after")
    def _schedule_fits(self) -> "ExperimentConfig":
        if not self.lr_schedule.constant and self.engine == "batched" and self.algorithm in DEFINITIONS and \
                not definition(self.algorithm).needs.synchronous:
            raise ConfigError(f"lr_schedule {self.lr_schedule._as_string()} on the batched engine needs a synchronous "
                              f"algorithm (its asynchronous nodes are at different iterations): use the process "
                              f"engine, or lr_schedule constant")
        return self

    @field_validator("task")
    @classmethod
    def _known_task(cls, value: str, info: ValidationInfo) -> str:
        value = value.strip()
        if value != "auto" and value not in TASKS and not info.data.get("models_module"):  # else checked once loaded
            raise ValueError(f"unknown task {value!r}: {did_you_mean(value, ['auto', *TASKS.names()])}choose auto, "
                             f"{', '.join(TASKS.names())}, or register your own in a --models-module file")
        return value

    @field_validator("sharing")
    @classmethod
    def _valid_sharing(cls, value: str) -> str:
        with about("sharing", value):
            return str(parse_sharing(value))

    @model_validator(mode="after")
    def _sharing_fits(self) -> "ExperimentConfig":
        if self.sharing == "full":
            return self
        _require(f"sharing {self.sharing}", "sharing full", [
            (self.algorithm in DEFINITIONS and not accepts_sharing(definition(self.algorithm).needs, self.sharing),
             f"algorithm {_either(names_that(lambda needs: accepts_sharing(needs, self.sharing)))} "
             f"(not {self.algorithm})"),
            (self.aggregation != "mean", "aggregation mean (robust rules need whole models)"),
            (bool(self.byzantine), "no byzantine nodes (attacks forge whole models)")])
        return self

    @field_validator("peer_sampling")
    @classmethod
    def _valid_sampling(cls, value: str, info: ValidationInfo) -> str:
        if "topology" not in info.data or "nodes" not in info.data:
            return value  # the error is theirs
        try:
            return check_sampling(value, info.data["topology"], info.data["nodes"])
        except TopologyError as exc:
            raise ValueError(exc.problem) from None  # named with its setting and value, as every field's error

    @model_validator(mode="after")
    def _sampling_fits(self) -> "ExperimentConfig":
        dynamic = self.dynamic()
        if not dynamic:
            return self
        _require(dynamic, "peer_sampling off" if self.peer_sampling != "off" else "another topology", [
            (self.algorithm in DEFINITIONS and not definition(self.algorithm).needs.dynamic,
             f"algorithm {_either(names_that(lambda needs: needs.dynamic))} (not {self.algorithm})"),
            (self.transport != "tcp", "transport tcp"), (self.aggregation != "mean", "aggregation mean"),
            (bool(self.byzantine), "no byzantine nodes"), (self.sharing != "full", "sharing full")])
        return self

    @field_validator("byzantine")
    @classmethod
    def _valid_byzantine(cls, value: str) -> str:
        parse_byzantine(value)
        return value.strip()

    @model_validator(mode="after")
    def _byzantine_nodes_exist(self) -> "ExperimentConfig":
        parse_byzantine(self.byzantine, self.nodes)
        return self

    def attackers(self) -> dict:
        """Bad nodes' behaviours, by rank (``byzantine``)."""
        return parse_byzantine(self.byzantine, self.nodes)

    @field_validator("slowdown")
    @classmethod
    def _valid_slowdown(cls, value: str) -> str:
        for item in filter(None, (part.strip() for part in value.split(","))):
            rank, sep, amount = item.partition(":")
            try:
                ok = bool(sep) and (rank == "*" or int(rank) >= 0) and _slowdown_amount(amount) is not None
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{item!r} is not RANK:FACTOR (>= 1, e.g. 0:3) or RANK:+TIME (e.g. *:+20ms)")
        return value.strip()

    @model_validator(mode="after")
    def _algorithm_fits(self) -> "ExperimentConfig":
        problem = algorithm_refusal(self) or definition(self.algorithm).conflict(self) \
            if self.algorithm in DEFINITIONS else None  # a user's: once loaded
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _exchanges_fit(self) -> "ExperimentConfig":
        if self.algorithm not in DEFINITIONS:  # a user's algorithm: once loaded (the engines refuse its mixing)
            return self
        problem = mixing_refusal(self.algorithm, self.mixing, self) or \
            objective_refusal(self.algorithm, self.objective, parse_optimizer(self.optimizer))
        if problem:
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _engine_can_run_it(self) -> "ExperimentConfig":
        if self.engine == "process" and self.nodes > PROCESS_NODES:
            raise ValueError(f"{self.nodes} nodes are too many processes for one machine (at most {PROCESS_NODES}): "
                             "use --engine batched")
        return self

    @classmethod
    def setting_name(cls, loc: tuple) -> str:
        """A section's field is named by its flat name, as flags and most files write it."""
        if len(loc) >= 2 and loc[0] in SECTIONS:
            return SECTIONS[loc[0]].FLAT_NAMES.get(str(loc[1]), str(loc[1]))
        return super().setting_name(loc)

    @property
    def link(self) -> TcpSettings | UdpSettings:
        """The chosen transport's settings."""
        return self.udp if self.transport == "udp" else self.tcp

    def dynamic(self) -> str:
        """What makes the run's peers change every round (``peer_sampling``, a dynamic topology),
        or "" for a static graph."""
        if self.peer_sampling != "off":
            return f"peer_sampling {self.peer_sampling}"
        return f"topology {self.topology}" if self.topology == ONE_PEER_EXPONENTIAL else ""

    def slowdown_of(self, rank: int) -> tuple[float, float]:
        """Node ``rank``'s emulated slowness: (factor on its step time, seconds added per step).
        An entry for the rank overrides one for ``*`` (every node)."""
        found = slowdown_entries(self.slowdown)
        return found.get(str(rank), found.get("*", (1.0, 0.0)))

    def slowdowns(self, nodes: int) -> tuple[list[float], list[float]]:
        """Every node's ``slowdown_of`` (factors, added seconds), the setting read once for all of them."""
        found = slowdown_entries(self.slowdown)
        factor, extra = found.get("*", (1.0, 0.0))
        factors, extras = [factor] * nodes, [extra] * nodes
        for rank, (factor, extra) in found.items():
            if rank.isdigit() and str(int(rank)) == rank and int(rank) < nodes:  # as slowdown_of reads them
                factors[int(rank)], extras[int(rank)] = factor, extra
        return factors, extras

    @property
    def checkpoint_interval(self) -> int:
        """Iterations between two checkpoints (0: none): ``checkpoint_every``, or by default every
        ``test_after`` iterations, at most 20 times a run."""
        if self.checkpoint_every is not None:
            return self.checkpoint_every
        return max(self.test_after, -(-self.iterations // 20))

    def checkpoint_due(self, done: int) -> bool:
        """Whether the run keeps a checkpoint once ``done`` iterations are done (never after the last)."""
        every = self.checkpoint_interval
        return bool(every) and done % every == 0 and done < self.iterations

    def fingerprint(self) -> str:
        """What makes two configurations the same run (all but where its results go), as a digest a
        checkpoint records: a run resumes only from its own."""
        import hashlib

        return hashlib.sha256(self.model_copy(update={"output": None}).to_yaml().encode()).hexdigest()[:16]

    def node_evaluates(self, rank: int) -> bool:
        """Whether node ``rank`` runs the periodic test evaluation."""
        return self.eval_nodes == 0 or rank < self.eval_nodes

    def to_yaml(self) -> str:
        """The resolved configuration as YAML (written next to every run's results)."""
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def algorithm_refusal(config: ExperimentConfig) -> str | None:
    """Why the run's algorithm, by its own declaration, cannot run with the rest of ``config``, or
    None (the algorithm must be registered: a user's once its module has loaded)."""
    return refusal(config.algorithm, definition(config.algorithm).needs, RunShape(
        engine=config.engine, transport=config.transport, sharing=config.sharing, aggregation=config.aggregation,
        byzantine=bool(config.byzantine), dynamic=config.dynamic(), full_epochs=config.full_epochs,
        plain_sgd=parse_optimizer(config.optimizer) == ("SGD", {}),
        emulated=_either([name for name in ("delay", "jitter", "rate") if getattr(config.net, name)] or [""]),
        outer=config.outer.spec if config.outer.active else ""))


def _either(names: list[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _require(what: str, otherwise: str, needs: list[tuple[bool, str]]) -> None:
    """ValueError naming the first thing ``what`` needs that the run lacks (each entry: whether it is
    lacking, and what it needs), and ``otherwise``, the setting that does without it."""
    for lacking, need in needs:
        if lacking:
            raise ValueError(f"{what} needs {need}" + (f"; or use {otherwise}" if otherwise else ""))


@functools.lru_cache(maxsize=8)
def slowdown_entries(text: str) -> dict[str, tuple[float, float]]:
    """A ``slowdown`` setting's entries, by rank (or ``*``): (factor, seconds added per step)."""
    found = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        rank, _, amount = item.partition(":")
        found[rank] = _slowdown_amount(amount)
    return found


def _slowdown_amount(text: str) -> tuple[float, float] | None:
    """``3`` -> (3.0, 0.0); ``+20ms`` -> (1.0, 0.02); None if neither."""
    text = text.strip()
    if text.startswith("+"):
        number = text[1:].removesuffix("ms")
        seconds = float(number) / 1000 if text.endswith("ms") else float(text[1:].removesuffix("s"))
        return (1.0, seconds) if seconds >= 0 else None
    factor = float(text)
    return (factor, 0.0) if factor >= 1 else None


def load_run_dataset(config: ExperimentConfig, whole: bool = True) -> "Dataset":
    """The dataset a run trains and tests on, as every engine and the report load it: ``config.dataset``,
    with ``reshuffle`` its train and test sets pooled and split again with the run's seed (a generated
    dataset: one user per node, from the run's seed; not ``whole``, only the users a sample of it
    needs, the others generated when asked for)."""
    from meshlearn.data import load_dataset  # loads torch: only once a run starts
    from meshlearn.tasks import resolve_task

    dataset = load_dataset(config.dataset, reshuffle=config.seed if config.reshuffle else None, context=config.context,
                           vocabulary=config.vocabulary, nodes=config.nodes, seed=config.seed, whole=whole)
    task = resolve_task(config.task, dataset.task, config.dataset)
    return dataset if task == dataset.task else dataclasses.replace(dataset, task=task)


def make_config(values: dict[str, Any]) -> ExperimentConfig:
    """Validate plain values (flat or in sections) into an ExperimentConfig, or raise ConfigError
    with one clear line."""
    return ExperimentConfig(**values)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Plain values from a YAML experiment file (validated later by make_config)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: give the path of a YAML experiment file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: fix its syntax") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings (key: value)")
    return {str(k).replace("-", "_"): v for k, v in values.items()}


def flat_fields() -> list[tuple[str, FieldInfo]]:
    """Every setting under its flat name (as flags and flat files write it), with its field; those
    of the user algorithms registered by now (``--models-module`` loaded) too."""
    fields = [(name, field) for name, field in ExperimentConfig.model_fields.items()
              if name not in SECTIONS and name != "algorithm_settings"]  # (filled by a user's algorithm's flags)
    fields += [(flat, SECTIONS[section].model_fields[name]) for flat, [(section, name), *_] in FLAT_ROUTES.items()]
    return fields + user_setting_fields()
