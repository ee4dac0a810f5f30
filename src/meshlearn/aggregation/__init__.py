"""Aggregation rules: how a set of models, each with a weight, becomes one model.

A rule is a pure function ``rule(models, weights) -> model`` over flat state vectors: no
threads, no sockets, no state, so it can be tested on hand-computed vectors and applied by any
algorithm (the leader's average today; D-PSGD's and gossip's neighbourhoods next). How much each
model counts (its weight) is decided apart from the rule, by the functions in ``weights``.
Rules register by name, one file each (``mean.py``); ``get_rule("mean")`` finds one.
"""

from meshlearn.aggregation.base import RULES, AggregationRule, get_rule, register_rule
from meshlearn.aggregation.mean import mean
from meshlearn.aggregation.weights import by_samples, by_staleness, equal

__all__ = ["RULES", "AggregationRule", "by_samples", "by_staleness", "equal", "get_rule", "mean", "register_rule"]
