"""Sharing schemes in the batched engine: every node runs the process engine's own scheme object
on its row (what it sends, what its neighbours read back, how they average it), one node after
another, so both engines compute the same thing."""

from __future__ import annotations

import torch

from meshlearn.algorithms.averaging import merge_shares_
from meshlearn.batched.mixing import Links
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.sharing import Shared, Sharing, make_sharing


class SharedMixing:
    """D-PSGD's exchange for every node when nodes send shares of their models (``sharing``):
    each row is averaged with what its neighbours' schemes made of theirs, per value over those
    who sent it (``missing_chunks``), or updated by the scheme itself (CHOCO-SGD)."""

    def __init__(self, sharing: str, state: torch.Tensor, links: Links, degrees: list[int], missing_chunks: str,
                 seed: int):
        self.schemes: list[Sharing] = [make_sharing(sharing, state.shape[1], state.dtype, seed)
                                       for _ in range(state.shape[0])]
        self.links, self.degrees = links, degrees
        self.rule = MISSING_CHUNK_RULES[missing_chunks]
        self.incoming: list[list[tuple[int, int, float]]] = [[] for _ in range(state.shape[0])]
        for link, (i, j, w) in enumerate(zip(links.receiver.tolist(), links.sender.tolist(), links.weight.tolist())):
            self.incoming[i].append((link, j, w))
        for scheme, row in zip(self.schemes, state):
            scheme.start(row)

    @torch.no_grad()
    def mix_(self, state: torch.Tensor, arrived: torch.Tensor, iteration: int) -> None:
        """Every row <- its average with what arrived of its neighbours' shares (``arrived``: per
        link, whether its message was in time)."""
        sent: list[Shared] = []
        for rank, scheme in enumerate(self.schemes):
            sent.append(scheme.decode(scheme.encode(state[rank], rank, iteration), rank, iteration))
        arrived = arrived.tolist()
        for rank, scheme in enumerate(self.schemes):
            row = state[rank]
            heard = {j: sent[j] for link, j, _ in self.incoming[rank] if arrived[link]}
            merge_shares_(scheme, row, {j: w for _, j, w in self.incoming[rank]}, heard, self.degrees, self.rule)
