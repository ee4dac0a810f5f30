"""The node runtime: one participant of a run, hostable many to a process; its algorithm runtimes
live in ``node.algorithms``.

Names are imported on first use, so the adapter, which needs only a runtime (``GossipAverager``),
loads no node factory."""

from meshlearn.lazy import lazy_exports

_WHERE = {"Node": "node", "Evaluation": "node", "evaluate_model": "node", "build_node": "factory",
          "load_run_dataset": "factory", "make_transport": "factory"}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
