"""Which chunks of each link's messages are lost: the run's ``net`` loss as masks, no sockets."""

from __future__ import annotations

import numpy as np

from meshlearn.checkpoint import Stateful
from meshlearn.netem import NetemSpec


class ChunkLoss(Stateful):
    """Per link, a two-state Markov chain (Gilbert-Elliott) over the chunks it carries, one
    message after another: the netem emulator's chain (``netem.Emulator``), whose stationary loss
    is exactly ``loss`` and whose lag-1 correlation between successive drops is ``corr``; with
    ``corr`` 0 every chunk is lost independently. A burst of losses then lasts 1 / (1 - a) chunks
    on average, with a = corr + loss (1 - corr) the chance to stay in the losing state."""

    state_fields = ("chunks", "dropped", "rng")

    def __init__(self, spec: NetemSpec, links: int, chunks: int, rng: np.random.Generator):
        self.loss = spec.loss
        self.chunks = chunks
        self.rng = rng
        self.b = spec.loss * (1 - spec.corr)  # P(drop | the last chunk passed)
        self.a = spec.corr + self.b  # P(drop | the last chunk was dropped)
        self.dropped = rng.random(links) < spec.loss  # each chain starts in its stationary distribution

    def draw(self) -> np.ndarray:
        """The next message of every link: [links, chunks], True where the chunk arrives."""
        arrives = np.ones((len(self.dropped), self.chunks), dtype=bool)
        if not self.loss:
            return arrives
        for chunk in range(self.chunks):
            threshold = np.where(self.dropped, self.a, self.b)
            self.dropped = self.rng.random(len(self.dropped)) < threshold
            arrives[:, chunk] = ~self.dropped
        return arrives
