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
    """True where the element's chunk arrived, over the whole state vector."""
    per_chunk = msg.chunks.chunk_bytes // element_size
    return msg.chunks.present.repeat_interleave(per_chunk)[:numel]


def per_chunk_weights(state: torch.Tensor, own_weight: float, received: list[tuple[float, int]],
                      masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """For every element, the Metropolis-Hastings weights renormalised over the node and the
    neighbours that delivered it, so a missing value biases toward neither side: with one of three
    equally weighted neighbours missing, the node and the other two get a third each.
    (``received``: each neighbour's weight and degree; ``masks``: 1.0 where its value arrived.)"""
    weights = [mask * weight for mask, (weight, _) in zip(masks, received)]
    total = own_weight + (torch.stack(weights).sum(0) if weights else torch.zeros(state.numel(), device=state.device))
    return [w / total for w in weights]


def fill_local_weights(state: torch.Tensor, own_weight: float, received: list[tuple[float, int]],
                       masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """The UDP study's rule: weights ``1 / (1 + max(k, d_j))`` with k the neighbours that delivered
    anything and d_j the sender's degree; a missing value counts as the node's own."""
    senders = len(received)
    return [mask * (1.0 / (1 + max(senders, degree))) for mask, (_, degree) in zip(masks, received)]


MissingChunkRule = Callable[[torch.Tensor, float, list[tuple[float, int]], list[torch.Tensor]], list[torch.Tensor]]
MISSING_CHUNK_RULES: dict[str, MissingChunkRule] = {"per-chunk": per_chunk_weights, "fill-local": fill_local_weights}


def masked_average_(state: torch.Tensor, own_weight: float,
                    received: list[tuple[float, int, torch.Tensor, torch.Tensor]], rule: MissingChunkRule) -> None:
    """In place: Metropolis-Hastings averaging of models of which only some values arrived.

    ``received`` holds, per neighbour, its Metropolis-Hastings weight, its degree, its values over
    the whole state and a bool mask of those that arrived; ``own_weight`` is the node's own (the
    weights of all neighbours and the node sum to one). ``rule`` (of ``MISSING_CHUNK_RULES``)
    gives each neighbour's weight per value; the node keeps the rest. With everything present
    every rule is plain Metropolis-Hastings averaging.
    """
    masks = [mask.to(state.device, torch.float32) for *_, mask in received]
    with torch.no_grad():
        weights = rule(state, own_weight, [(weight, degree) for weight, degree, *_ in received], masks)
        own = 1.0 - (torch.stack(weights).sum(0) if weights else torch.zeros(state.numel(), device=state.device))
        state.mul_(own.to(state.dtype))
        for weight, (_, _, values, _) in zip(weights, received):
            state.addcmul_(weight.to(state.dtype), values.to(state.device))


def average_shares_(state: torch.Tensor, shares: list[tuple[float, int, torch.Tensor, torch.Tensor | None]],
                    rule: MissingChunkRule) -> None:
    """In place: ``state`` <- its average with the neighbours' shares (weight, degree, values,
    mask of the values sent, or None for all of them), each value over those who sent it by
    ``rule``; the node keeps the weight of the neighbours that sent nothing."""
    own = 1.0 - sum(w for w, _, _, _ in shares)
    if all(mask is None for _, _, _, mask in shares):
        weighted_average_(state, own, [(w, values) for w, _, values, _ in shares])
        return
    everything = torch.ones(state.numel(), dtype=torch.bool)
    masked_average_(state, own, [(w, degree, values, everything if mask is None else mask)
                                 for w, degree, values, mask in shares], rule)


def chunked_average_(state: torch.Tensor, own_weight: float, received: list[tuple[float, Message]],
                     rule: MissingChunkRule | str) -> None:
    """In place: Metropolis-Hastings averaging where some chunks of some models are missing
    (``received``: each neighbour's weight and message; ``masked_average_`` for the rest)."""
    if isinstance(rule, str):
        if rule not in MISSING_CHUNK_RULES:
            raise ValueError(f"unknown missing-chunk rule {rule!r}")
        rule = MISSING_CHUNK_RULES[rule]
    numel, size = state.numel(), state.element_size()
    masked_average_(state, own_weight, [(weight, msg.degree, msg.chunks.vector, _element_mask(msg, numel, size))
                                        for weight, msg in received], rule)
