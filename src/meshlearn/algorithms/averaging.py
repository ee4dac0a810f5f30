"""Averaging kernels on whole flat buffers."""

from __future__ import annotations

import torch


def weighted_average_(target: torch.Tensor, own_weight: float, others: list[tuple[float, torch.Tensor]]) -> None:
    """In place: ``target = own_weight * target + sum(w * t for w, t in others)``.

    One pass over memory per term; received tensors may live on another device (the CPU)
    and are moved once.
    """
    with torch.no_grad():
        target.mul_(own_weight)
        for weight, tensor in others:
            target.add_(tensor.to(target.device, non_blocking=True), alpha=weight)
