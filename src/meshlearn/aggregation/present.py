"""A rule applied over what arrived: per chunk, over the models whose chunk is present.

Over a lossy transport each received model may miss some chunks, and a model that missed its
deadline is missing whole. The rule then aggregates, for every chunk, the node's own model and
the received models that hold the chunk. Chunks (of all nodes in a batch) with the same set of
models present are aggregated in one call, so the cost is one rule call per distinct pattern,
not per chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshlearn.aggregation.base import AggregationRule

MAX_MODELS = 62  # patterns are bit sets in an int64


def aggregate_present(rule: AggregationRule, models: torch.Tensor, weights: torch.Tensor,
                      present: torch.Tensor | None = None, chunk_elements: int = 0,
                      own_always: bool = True) -> torch.Tensor:
    """``rule`` over ``models`` ``[B, K, P]`` with ``weights`` ``[B, K]``, where ``present``
    ``[B, K, C]`` says which of the ``C`` chunks (of ``chunk_elements`` each; C = 1: whole models)
    of each model arrived. Row 0 (the node's own model) is taken as present (``own_always``), or
    as ``present`` says. A chunk no model holds is 0 (the weighted sum of nothing). Returns ``[B, P]``."""
    batch, k, p = models.shape
    if present is None or bool(present[:, 1 if own_always else 0:].all()):
        return rule(models, weights)
    if k > MAX_MODELS:
        raise ValueError(f"per-chunk aggregation over {k} models: at most {MAX_MODELS}")
    present = present.to(torch.bool).clone()
    if own_always:
        present[:, 0] = True
    chunks = present.shape[-1]
    size = chunk_elements if chunks > 1 else p
    if chunks * size < p:
        raise ValueError(f"{chunks} chunks of {size} elements do not cover {p}")
    cut = F.pad(models, (0, chunks * size - p)).view(batch, k, chunks, size)
    bits = torch.ones(k, dtype=torch.int64, device=models.device) << torch.arange(k, device=models.device)
    patterns = (present.to(torch.int64) * bits[None, :, None]).sum(1)  # [B, C]
    out = models.new_empty(batch, chunks, size)
    for pattern in patterns.unique().tolist():
        rows, columns = (patterns == pattern).nonzero(as_tuple=True)
        if pattern == 0:  # nobody's chunk (an own weight of 0, and nothing came)
            out[rows, columns] = 0
            continue
        members = torch.tensor([i for i in range(k) if pattern >> i & 1], device=models.device)
        picked = cut[rows[:, None], members[None, :], columns[:, None]]  # [n, members, size]
        out[rows, columns] = rule(picked, weights[rows[:, None], members[None, :]])
    return out.view(batch, chunks * size)[:, :p]
