"""Averaging kernels on whole flat buffers, including per-chunk weights for lossy transports."""

from __future__ import annotations

from typing import Callable

import torch

from meshlearn.wire import Message


def weighted_average_(target: torch.Tensor, own_weight: float, others: list[tuple[float, torch.Tensor]]) -> None:
    """In place: ``target = own_weight * target + sum(w * t for w, t in others)``.

    One pass over memory per term; received tensors may live on another device (the CPU)
    and are moved once.
    """
    with torch.no_grad():
        target.mul_(own_weight)
        for weight, tensor in others:
            target.add_(tensor.to(target.device, non_blocking=True), alpha=weight)


def _element_mask(msg: Message, numel: int, element_size: int) -> torch.Tensor:
    """1.0 where the element's chunk arrived, else 0.0, over the whole state vector."""
    per_chunk = msg.chunks.chunk_bytes // element_size
    return msg.chunks.present.repeat_interleave(per_chunk)[:numel].to(torch.float32)


def per_chunk_weights(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                      masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """For every chunk, the Metropolis-Hastings weights renormalised over the node and the
    neighbours whose chunk arrived, so a lost chunk biases toward neither side: with one of three
    equally weighted neighbours missing, the node and the other two get a third each."""
    weights = [mask * weight for mask, (weight, _) in zip(masks, received)]
    total = own_weight + (torch.stack(weights).sum(0) if weights else torch.zeros(state.numel(), device=state.device))
    return [w / total for w in weights]


def fill_local_weights(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                       masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The UDP study's rule: weights ``1 / (1 + max(k, d_j))`` with k the neighbours that delivered
    any chunk and d_j the sender's degree; a missing chunk counts as the node's own values."""
    senders = len(received)
    return [mask * (1.0 / (1 + max(senders, msg.degree))) for mask, (_, msg) in zip(masks, received)]


MissingChunkRule = Callable[[torch.Tensor, float, list[tuple[float, Message]], list[torch.Tensor]], list[torch.Tensor]]
MISSING_CHUNK_RULES: dict[str, MissingChunkRule] = {"per-chunk": per_chunk_weights, "fill-local": fill_local_weights}


def chunked_average_(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                     rule: MissingChunkRule | str) -> None:
    """In place: Metropolis-Hastings averaging where some chunks of some models are missing.

    ``received`` pairs each neighbour's model with its Metropolis-Hastings weight, and
    ``own_weight`` is the node's own (the weights of all neighbours and the node sum to one).
    ``rule`` (a function of ``MISSING_CHUNK_RULES``, or its name) gives each neighbour's weight per
    element; the node keeps the rest. With nothing lost every rule equals plain Metropolis-Hastings.
    """
    if isinstance(rule, str):
        if rule not in MISSING_CHUNK_RULES:
            raise ValueError(f"unknown missing-chunk rule {rule!r}")
        rule = MISSING_CHUNK_RULES[rule]
    numel, size = state.numel(), state.element_size()
    masks = [_element_mask(msg, numel, size).to(state.device) for _, msg in received]
    with torch.no_grad():
        weights = rule(state, own_weight, received, masks)
        own = 1.0 - (torch.stack(weights).sum(0) if weights else torch.zeros(numel, device=state.device))
        state.mul_(own.to(state.dtype))
        for weight, (_, msg) in zip(weights, received):
            state.addcmul_(weight.to(state.dtype), msg.chunks.vector.to(state.device))
