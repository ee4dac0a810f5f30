"""What a run trains and how, in one schema: the model and its data's split, the optimizer and its
schedule, the algorithm with its own section, privacy, the outer optimizer and the transport.

``TrainingSettings`` is composed by every schema that describes a training run: the experiment
configuration (``simulate``, ``experiment``, ``node``), and the network's task settings, which a
request (``meshlearn request``) and the spec each provider receives share. A field added here is
therefore, with nothing else written, a flag of ``simulate`` and of ``request``, a key of experiment
and task files, part of the spec that travels to providers, and a setting of the engine each
provider runs (``TaskSpec.experiment_config``). Each composing schema checks what concerns its own
fields (the nodes and engine of an experiment, the providers of a task).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo

from meshlearn.aggregation.spec import BUILT_IN_RULES, RULE_HELP, parse_rule
from meshlearn.data.specs import VOCABULARY_HELP, VocabularyKind
from meshlearn.definitions.base import DEFINITIONS, algorithms_help, definition
from meshlearn.definitions.pushsum import PushSumSettings
from meshlearn.definitions.qgdsgdm import QuasiGlobalSettings
from meshlearn.definitions.settings import (
    DpsgdSettings,
    FedAvgSettings,
    GossipSettings,
    LeaderSettings,
)
from meshlearn.errors import ConfigError, about
from meshlearn.optim import OPTIMIZER_HELP, parse_optimizer
from meshlearn.outer import OUTER_HELP, OuterOptimizer
from meshlearn.privacy.settings import DP_HELP, DPSettings
from meshlearn.schedule import SCHEDULE_HELP, LrSchedule
from meshlearn.settings import MAX_SEED, Settings

NAME_CHARS = 64  # the longest model, partition, algorithm or rule name (bounds what a task spec carries)
SPEC_CHARS = 256  # the longest optimizer written as a small language
MAX_USER_SETTINGS = 64  # the most settings a user's algorithm is given


class TrainingSettings(Settings):
    """One training run's model, data split, optimization, algorithm, privacy and transport: the
    fields the experiment configuration and a network task share (see the module)."""

    model: str = Field("mlp", max_length=NAME_CHARS, description="mlp | lenet | simplecnn | resnet18 | gpt-tiny | "
                       "gpt-small (language models) | any registered model")
    context: int = Field(128, ge=2, le=65_536, description="tokens a language model reads at once (text datasets: "
                         "the windows its samples are)")
    vocabulary: VocabularyKind = Field("bytes", description=VOCABULARY_HELP)
    partition: str = Field("iid", max_length=NAME_CHARS, description="iid | shards:K (McMahan et al.'s label shards) | "
                           "kshard:K (DecentralizePy's k-shard) | dirichlet:ALPHA | writers (a leaf: dataset's "
                           "writers, in blocks per node; synthetic:'s users, one per node)")
    seed: int = Field(90, ge=0, le=MAX_SEED, description="same seed, same partitions, graph and initial model")
    batch_size: int = Field(32, ge=1, description="mini-batch size")
    lr: float = Field(0.05, gt=0, allow_inf_nan=False, description="learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False, description="SGD weight decay")
    optimizer: str = Field("sgd", max_length=SPEC_CHARS, description=OPTIMIZER_HELP)
    lr_schedule: LrSchedule = Field(LrSchedule(), description="learning rate by iteration: " + SCHEDULE_HELP)
    algorithm: str = Field("dpsgd", max_length=NAME_CHARS, description=algorithms_help())
    aggregation: str = Field("mean", max_length=NAME_CHARS, description="how each node aggregates the models it "
                             "receives (dpsgd, gossip, leader): " + RULE_HELP)
    eval_samples: int = Field(0, ge=0, description="evaluate on N test samples, evenly spaced (0 = all)")
    transport: Literal["tcp", "udp"] = Field("tcp", description="tcp (ZeroMQ, reliable) | udp (checksummed "
                                                                "datagrams, tolerates loss)")
    outer: OuterOptimizer = Field(OuterOptimizer(), description=OUTER_HELP)
    dp: DPSettings = Field(DPSettings(), description=DP_HELP)
    privacy: list[str] = Field([], max_length=8, description="privacy mechanisms a --models-module file registers, "
                               "by name (NAME[,NAME]; the built-in ones are asked by their own settings: dp, "
                               "secure_aggregation, central_dp)")
    # the algorithms' sections, each named as its algorithm (``ALGORITHM_SECTIONS``)
    dpsgd: DpsgdSettings = Field(DpsgdSettings(), description="D-PSGD")
    gossip: GossipSettings = Field(GossipSettings(), description="gossip (dpwa)")
    leader: LeaderSettings = Field(LeaderSettings(), description="leader aggregation (CloudMesh)")
    fedavg: FedAvgSettings = Field(FedAvgSettings(), description="FedAvg with a parameter server")
    pushsum: PushSumSettings = Field(PushSumSettings(), description="push-sum (Stochastic Gradient Push)")
    qgdsgdm: QuasiGlobalSettings = Field(QuasiGlobalSettings(), description="QG-DSGDm (quasi-global momentum)")
    algorithm_settings: dict[str, Any] = Field(
        default_factory=dict, max_length=MAX_USER_SETTINGS, description="the settings of an algorithm registered by "
        "--models-module, by their names (its flags, once the module is loaded, fill it); checked against the "
        "settings class it declares once the module has loaded")

    @model_validator(mode="before")
    @classmethod
    def _route_user_settings(cls, values: Any) -> Any:
        """A registered user algorithm's settings given flat (its flags, or keys of a file) or as a
        section named as the algorithm (``half-step: {pull: 0.5}``, as a built-in one's) go into
        ``algorithm_settings`` (its module must be loaded for its names to be known)."""
        if not isinstance(values, dict) or str(values.get("algorithm", "")).strip() in ALGORITHM_SECTIONS:
            return values
        name = str(values.get("algorithm", "")).strip()
        declared = user_settings_class(name)
        given = [flat for flat in (declared.flat_names() if declared else {}) if flat in values]
        sections = [key for key in dict.fromkeys((name, name.replace("-", "_"))) if declared and
                    isinstance(values.get(key), dict)]
        if not given and not sections:
            return values
        values = dict(values)
        routed = dict(values.get("algorithm_settings") or {})
        for key in sections:
            routed.update(values.pop(key))
        for flat in given:
            routed[declared.flat_names()[flat]] = values.pop(flat)
        values["algorithm_settings"] = routed
        return values

    @model_validator(mode="after")
    def _settings_where_they_belong(self) -> TrainingSettings:
        if self.algorithm_settings and self.algorithm in ALGORITHM_SECTIONS:
            raise ConfigError(f"algorithm_settings is for an algorithm registered by --models-module; "
                              f"{self.algorithm}'s settings are its own section ({self.algorithm}: or its flags)")
        return self

    def settings_of(self, algorithm: str) -> Settings | None:
        """The settings ``algorithm`` runs with: a built-in one's section, or for one registered by
        a user (its module loaded) its declared settings class filled from ``algorithm_settings``;
        None for one without settings. ConfigError names a bad or unknown setting."""
        if algorithm in ALGORITHM_SECTIONS:
            return getattr(self, algorithm)
        declared = definition(algorithm).settings
        if declared is None:
            if self.algorithm_settings:
                raise ConfigError(f"algorithm {algorithm} declares no settings: drop algorithm_settings "
                                  f"({', '.join(self.algorithm_settings)})")
            return None
        try:
            return declared(**self.algorithm_settings)
        except ConfigError as exc:  # named as its flag and file key say it
            flat = declared.FLAT_NAMES.get(exc.setting, exc.setting) if exc.setting else None
            raise ConfigError(exc.problem, setting=flat, value=exc.value) from None

    @field_validator("model", "partition")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @field_validator("privacy", mode="before")
    @classmethod
    def _privacy_names(cls, value: Any) -> Any:
        """``"a, b"`` (a flag) or a list (a file, a task spec) -> the names, once each; a built-in
        mechanism named here is refused: its own settings ask for it."""
        from meshlearn.privacy.mechanism import BUILT_IN

        names = value.split(",") if isinstance(value, str) else value
        if not isinstance(names, list | tuple):
            return value  # the type's error
        names = list(dict.fromkeys(str(name).strip() for name in names if str(name).strip()))
        for name in names:
            if len(name) > NAME_CHARS:
                raise ValueError(f"a privacy mechanism's name is at most {NAME_CHARS} characters")
            if name in BUILT_IN:
                raise ValueError(f"{name} is built in: ask for it by its own setting (dp, secure_aggregation, "
                                 "central_dp), not by privacy")
        return names

    @field_validator("aggregation")
    @classmethod
    def _valid_rule(cls, value: str) -> str:
        # a built-in rule's arguments are checked here; whether a name is registered, once the
        # user's --models-module has loaded (sim.checks, the node when it builds its rule, a request)
        with about("aggregation", value):
            return str(parse_rule(value)) if parse_rule(value).name in BUILT_IN_RULES else value.strip()

    @field_validator("optimizer")
    @classmethod
    def _valid_optimizer(cls, value: str) -> str:
        with about("optimizer", value):
            parse_optimizer(value)
        return value.strip()

    @field_validator("algorithm")
    @classmethod
    def _stripped(cls, value: str) -> str:
        return value.strip()


# The fields that are an algorithm's own section: those named as a registered algorithm
ALGORITHM_SECTIONS = tuple(name for name in TrainingSettings.model_fields if name in DEFINITIONS)


def user_settings_class(algorithm: str) -> type[Settings] | None:
    """The settings class a user's algorithm declares, where it is registered by now (its module
    loaded) and has one; None for a built-in one (its section is a field) or an unknown one."""
    if algorithm in ALGORITHM_SECTIONS or algorithm not in DEFINITIONS.extensions():
        return None
    return definition(algorithm).settings


def user_setting_fields() -> list[tuple[str, FieldInfo]]:
    """Every setting of the user algorithms registered by now, by flat name, with its field: the
    flags ``simulate`` and ``node`` add once ``--models-module`` has loaded."""
    return [(flat, declared.model_fields[name]) for algorithm in DEFINITIONS.extensions()
            if (declared := user_settings_class(algorithm)) is not None
            for flat, name in declared.flat_names().items()]
