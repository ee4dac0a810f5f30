"""No exchange: every node trains alone (a baseline)."""

from __future__ import annotations

import numpy as np

from meshlearn.batched.algorithms.base import BatchedAlgorithm


class BatchedLocal(BatchedAlgorithm):
    """Each node keeps its own model."""

    name = "local"

    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        return {"comm": np.zeros(self.ctx.config.nodes)}
