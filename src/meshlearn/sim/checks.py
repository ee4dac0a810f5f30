"""What a user can get wrong in a run's config, checked before torch or any data loads: a wrong
name or a port in use is one line in well under a second, not after the node processes start."""

from __future__ import annotations

from meshlearn.aggregation.spec import RULES, parse_rule
from meshlearn.config import ExperimentConfig, algorithm_refusal
from meshlearn.data.partition import parse_partition
from meshlearn.data.specs import parse_spec
from meshlearn.definitions.base import DEFINITIONS
from meshlearn.errors import ConfigError, about
from meshlearn.models.registry import MODELS
from meshlearn.plugins import load_user_module
from meshlearn.sharing.spec import check_sharing
from meshlearn.topology import Graph, build_topology
from meshlearn.transport.ports import ensure_port_free


def run_topology(config: ExperimentConfig) -> str:
    """The graph a run's nodes talk over: ``topology``, except for an algorithm whose nodes talk to a
    server (FedAvg's node 0), whose graph is the star around it whatever ``topology`` says (a random
    regular graph of 100,000 nodes took 13 s to build, for nothing)."""
    from meshlearn.definitions.base import DEFINITIONS

    talks_to = getattr(DEFINITIONS.get(config.algorithm), "talks_to", "neighbours") \
        if config.algorithm in DEFINITIONS else "neighbours"
    return "star" if talks_to == "server" and config.nodes > 1 else config.topology


def check_before_start(config: ExperimentConfig) -> Graph:
    """The run's graph, once its topology, dataset and partition specs, model name, algorithm, aggregation rule,
    sharing scheme and fixed ports check out (an error names the setting it is about)."""
    with about("topology", config.topology):
        graph = build_topology(run_topology(config), config.nodes, config.seed)
    if config.models_module:  # the user's own models and datasets: registered before their names are checked
        with about("models_module", config.models_module):
            load_user_module(config.models_module)
    with about("dataset", config.dataset):
        parse_spec(config.dataset)
    with about("partition", config.partition):
        parse_partition(config.partition)
    with about("model", config.model):
        MODELS.check(config.model)
    with about("algorithm", config.algorithm):
        DEFINITIONS.check(config.algorithm)
    with about("algorithm_settings", config.algorithm_settings):
        config.settings_of(config.algorithm)  # a user's algorithm's settings, against the class it declares
    problem = algorithm_refusal(config)  # a user's algorithm's declaration, now that it is registered
    if problem:
        raise ConfigError(problem)
    with about("aggregation", config.aggregation):
        RULES.check(parse_rule(config.aggregation).name)
    with about("sharing", config.sharing):
        check_sharing(config.sharing)
    if config.base_port:
        with about("base_port", config.base_port):
            for rank in range(config.nodes):
                ensure_port_free(config.host, config.base_port + rank)
    return graph
