"""The algorithm layer, below both engines: per algorithm one file that declares what it needs
and, for a synchronous one, gives its rules as functions over stacks of models (``base``). The
process engine runs them for one node, the batched engine for every node at once. Torch only: no
sockets, no configuration, no engine; nothing here loads torch at import."""

from meshlearn.lazy import lazy_exports

_WHERE = {
    "DEFINITIONS": "base", "Definition": "base", "Exchange": "base", "RoundAlgorithm": "base", "State": "base",
    "definition": "base", "names_that": "base", "algorithms_help": "base", "register_algorithm": "base", "Needs": "needs",
    "RunShape": "needs", "refusal": "needs",
    "DpsgdSettings": "settings", "FedAvgSettings": "settings", "GossipSettings": "settings",
    "LeaderSettings": "settings", "PushSumSettings": "pushsum", "QuasiGlobalSettings": "qgdsgdm",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
