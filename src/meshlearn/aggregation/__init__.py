"""Aggregation rules: how a node's own model and the models it received become its next model.

A rule is a small class (one file each) over stacked flat states: ``rule(models, weights)`` with
``models`` of shape ``[..., K, P]`` (K models, row 0 the aggregating node's own) and ``weights``
``[..., K]``, returning ``[..., P]``. No threads, no sockets, no state: tested on hand-computed
vectors, applied alike by D-PSGD, gossip and the leader, in both engines, over whole states or per
chunk of what arrived (``present``). How much a model counts is decided apart from the rule, by
``weights``. ``get_rule("trimmed-mean:1")`` builds one from its name (``spec``: no torch).

Names are imported on first use, so reading settings does not load torch.
"""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "AggregationRule": "base", "get_rule": "base", "register_rule": "base", "RULES": "spec",
    "RuleSpec": "spec", "parse_rule": "spec", "check_rule": "spec", "RULE_HELP": "spec",
    "aggregate_present": "present", "PeerWatch": "suspects",
    "by_samples": "weights", "by_staleness": "weights", "equal": "weights",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
