"""What a user can get wrong in a run's config, checked before torch or any data loads: a wrong
name or a port in use is one line in well under a second, not after the node processes start."""

from __future__ import annotations

from meshlearn.aggregation.spec import RULES, parse_rule
from meshlearn.config import ExperimentConfig, algorithm_refusal
from meshlearn.data.specs import parse_spec
from meshlearn.definitions.base import DEFINITIONS
from meshlearn.errors import ConfigError
from meshlearn.models.registry import MODELS
from meshlearn.plugins import load_user_module
from meshlearn.sharing.spec import check_sharing
from meshlearn.topology import Graph, build_topology
from meshlearn.transport.ports import ensure_port_free


def check_before_start(config: ExperimentConfig) -> Graph:
    """The run's graph, once its topology, dataset spec, model name, algorithm, aggregation rule, sharing scheme
    and fixed ports check out."""
    graph = build_topology(config.topology, config.nodes, config.seed)
    if config.models_module:  # the user's own models and datasets: registered before their names are checked
        load_user_module(config.models_module)
    parse_spec(config.dataset)
    MODELS.check(config.model)
    DEFINITIONS.check(config.algorithm)
    problem = algorithm_refusal(config)  # a user's algorithm's declaration, now that it is registered
    if problem:
        raise ConfigError(problem)
    RULES.check(parse_rule(config.aggregation).name)
    check_sharing(config.sharing)
    if config.base_port:
        for rank in range(config.nodes):
            ensure_port_free(config.host, config.base_port + rank)
    return graph
