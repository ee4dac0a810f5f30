"""D-PSGD's missing-chunk average for one node of the process engine: its missing-value rules
(``definitions.dpsgd.MISSING_CHUNK_RULES``) over the messages a lossy transport delivered in part.
The round runner (``rounds``) takes it for every definition whose declaration takes a lossy
transport; D-PSGD itself runs on the round runner like every ``RoundAlgorithm``."""

from __future__ import annotations

import torch

from meshlearn.definitions.averaging import masked_average_
from meshlearn.definitions.dpsgd import MissingValueRule
from meshlearn.wire import Message


def chunked_average_(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                     rule: MissingValueRule) -> None:
    """In place: Metropolis-Hastings averaging where some chunks of some payloads are missing
    (``received``: each sender's weight and message; ``masked_average_`` per chunk)."""
    chunk_elements = received[0][1].chunks.chunk_bytes // state.element_size() if received else 1
    masked_average_(state, own_weight, [(weight, msg.degree, msg.chunks.vector, msg.chunks.present)
                                        for weight, msg in received], rule, chunk_elements)
