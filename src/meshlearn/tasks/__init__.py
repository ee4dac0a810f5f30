"""Tasks: what a model learns from a dataset (a loss, predictions, the metrics of an evaluation).

Built in: ``classification`` (images, class labels) and ``language-model`` (text, the next
token). A user's task is a ``Task`` subclass registered with ``register_task`` in the
``--models-module`` file. Names are imported on first use: the spec module loads no torch."""

from meshlearn.lazy import lazy_exports

_WHERE = {"TASKS": "spec", "TASK_HELP": "spec", "Task": "base", "register_task": "base", "task_of": "base",
          "resolve_task": "spec"}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
