"""The batched engine: every node of a run in one process, as one [N, P] state, trained together
(``torch.func``), exchanging through sparse products, timed by a cost model (``engine: batched``).

Names are imported on first use. Its settings live outside the package
(``meshlearn.enginesettings``): the configuration reads them without importing an engine."""

from meshlearn.lazy import lazy_exports

_WHERE = {"BatchedSimulation": "engine", "StackedState": "stacked"}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
