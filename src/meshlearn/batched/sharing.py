"""Sharing schemes in the batched engine: every node runs the process engine's own scheme object
on its row (what it sends, what its neighbours read back, how they average it), one node after
another, so both engines compute the same thing. Over a lossy network a link's message loses
chunks as a UDP datagram would: its bytes, laid out by the scheme, read as zeros there, and the
receiver's scheme reads what its rule can place (``Sharing.receive``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from meshlearn.batched.mixing import Links
from meshlearn.checkpoint import Stateful
from meshlearn.definitions.averaging import take_shares_
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.sharing import Shared, Sharing, make_sharing


class SharedMixing(Stateful):
    """D-PSGD's exchange for every node when nodes send shares of their models (``sharing``):
    each row is averaged with what its neighbours' schemes made of theirs, per value over those
    who sent it (``missing_chunks``), or updated by the scheme itself (CHOCO-SGD). ``chunk_bytes``:
    the size of a message's chunks over a lossy network (0: messages arrive whole or not at all)."""

    state_fields = ("schemes",)

    def __init__(self, sharing: str, state: torch.Tensor, links: Links, degrees: list[int], missing_chunks: str,
                 seed: int, chunk_bytes: int = 0):
        self.schemes: list[Sharing] = [make_sharing(sharing, state.shape[1], state.dtype, seed, lossy=chunk_bytes > 0)
                                       for _ in range(state.shape[0])]
        self.links, self.degrees, self.chunk_bytes = links, degrees, chunk_bytes
        self.rule = MISSING_CHUNK_RULES[missing_chunks]
        self.incoming: list[list[tuple[int, int, float]]] = [[] for _ in range(state.shape[0])]
        for link, (i, j, w) in enumerate(zip(links.receiver.tolist(), links.sender.tolist(), links.weight.tolist())):
            self.incoming[i].append((link, j, w))
        for scheme, row in zip(self.schemes, state):
            scheme.start(row)

    @property
    def chunks(self) -> int:
        """Chunks per message over a lossy network (0 when messages are not chunked)."""
        return -(-self.schemes[0].wire_bytes() // self.chunk_bytes) if self.chunk_bytes and self.schemes else 0

    @torch.no_grad()
    def mix_(self, state: torch.Tensor, arrived: torch.Tensor, iteration: int) -> None:
        """Every row <- its average with what arrived of its neighbours' shares (``arrived``: per
        link, whether its message was in time, or, [links, chunks], which of its chunks were)."""
        sent = [scheme.encode(state[rank], rank, iteration) for rank, scheme in enumerate(self.schemes)]
        whole = [_read(scheme, tensors, rank, iteration) for rank, (scheme, tensors) in enumerate(zip(self.schemes, sent))]
        arrived = arrived.cpu()
        for rank, scheme in enumerate(self.schemes):
            came = [(j, self._receive(scheme, sent[j], whole[j], arrived[link], j, iteration))
                    for link, j, _ in self.incoming[rank] if bool(arrived[link].any())]
            take_shares_(scheme, state[rank], {j: w for _, j, w in self.incoming[rank]}, came, self.degrees, self.rule)

    def _receive(self, scheme: Sharing, tensors: dict[str, torch.Tensor], whole: Shared | None, chunks: torch.Tensor,
                 sender: int, iteration: int) -> Callable[[], Shared | None]:
        """How ``scheme`` reads ``sender``'s message ``tensors`` of which ``chunks`` arrived: ``whole``
        (its read, once for every receiver) where all did, else what came of it."""
        if bool(chunks.all()):
            return lambda: whole
        return lambda: scheme.receive(scheme.layout().received(tensors, chunks, self.chunk_bytes), sender, iteration,
                                      (chunks, self.chunk_bytes))


def _read(scheme: Sharing, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared | None:
    """What ``scheme`` reads of ``sender``'s whole message; None where it refuses it (a diverged
    model's NaN), as the process engine's node refuses that neighbour's model."""
    try:
        return scheme.receive(tensors, sender, iteration)
    except ValueError:
        return None
