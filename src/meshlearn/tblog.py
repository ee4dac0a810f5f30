"""TensorBoard event files of one run: a writer per node (``node_3``, or a network task's
``provider_p0``) and one for the mean and std across nodes (``mean``), so ``tensorboard --logdir
DIR`` shows the nodes and their mean side by side, and several runs under one DIR."""

from __future__ import annotations

import re
from pathlib import Path

from meshlearn.errors import UserInputError

PER_NODE_LIMIT = 64  # beyond this many nodes only the mean is written (thousands of files help nobody)
MEAN = "mean"


def require_tensorboard() -> None:
    """One-line UserInputError when the optional ``tensorboard`` package is missing."""
    try:
        import tensorboard  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        raise UserInputError("--tensorboard needs the tensorboard package: pip install 'meshlearn[tensorboard]'"
                             ) from None


def run_folder(root: str | Path, name: str) -> Path:
    """Where one run's event files go under ``root``: a folder named after the run."""
    safe = re.sub(r"[^A-Za-z0-9_.=+-]+", "_", name).strip("._") or "run"
    return Path(root) / safe


class ScalarLog:
    """Scalars of one run, by writer (a node's name, or ``MEAN``); ``close()`` flushes them."""

    def __init__(self, folder: str | Path, nodes: int | None = None):
        self.folder = Path(folder)
        self.per_node = nodes is None or nodes <= PER_NODE_LIMIT
        self._writers: dict[str, object] = {}

    def _writer(self, name: str):
        writer = self._writers.get(name)
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=str(self.folder / name), max_queue=100, flush_secs=5)
            self._writers[name] = writer
        return writer

    def add(self, name: str, tag: str, value: float | None, step: int) -> None:
        """One scalar of writer ``name`` (a node's writer is skipped for runs of many nodes)."""
        if value is None or (name != MEAN and not self.per_node):
            return
        self._writer(name).add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        for writer in self._writers.values():
            writer.flush()

    def close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()
