"""The process engine's algorithm runtimes: the ``Algorithm`` interface a node drives, the round
runner of every ``RoundAlgorithm`` (``rounds``: D-PSGD among them, with the exchange features
their declarations take), and the runtimes of the built-in algorithms that need their own
(gossip, the leader; ``runtimes`` picks one by name).

Names are imported on first use."""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "Algorithm": "base", "AlgorithmContext": "base", "LocalOnly": "base", "make_algorithm": "runtimes",
    "RoundRunner": "rounds", "Gossip": "gossip", "GossipAverager": "gossip", "Leader": "leader",
    "Election": "election",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
