"""The process engine's algorithm runtimes: the ``Algorithm`` interface a node drives, the round
runner of every ``RoundAlgorithm`` (``rounds``), and the runtimes of the built-in algorithms that
need their own (D-PSGD's variants, gossip, the leader; ``runtimes`` picks one by name).

Names are imported on first use."""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "Algorithm": "base", "AlgorithmContext": "base", "LocalOnly": "base", "make_algorithm": "runtimes",
    "RoundRunner": "rounds", "DPSGD": "dpsgd", "Gossip": "gossip", "GossipAverager": "gossip", "Leader": "leader",
    "Election": "election",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
