"""Algorithms: how nodes combine their models. Each registers itself by name; their settings live
in ``definitions.settings`` (which does not load torch).

Names are imported on first use, so reading settings does not load the algorithms."""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "ALGORITHMS": "base", "Algorithm": "base", "AlgorithmContext": "base", "register_runtime": "base",
    "algorithm_class": "runtimes", "make_algorithm": "runtimes", "RoundRunner": "rounds", "DPSGD": "dpsgd",
    "Gossip": "gossip", "GossipAverager": "gossip", "Leader": "leader", "Election": "election",
    "LeaderState": "leaderstate",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
