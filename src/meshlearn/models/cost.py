"""What one local SGD step of a model costs in floating-point operations, counted once from its
shapes: the batched engine's default model of compute time, the same on any machine."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F


def step_flops(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Floating-point operations of one training step of ``model`` on a batch of ``batch_size``
    inputs like ``sample`` (one input as the model reads it: its shape and dtype): the matrix products and convolutions of the forward pass and of the
    backward pass of the cross-entropy loss, as ``torch.utils.flop_counter`` counts them
    (elementwise work and the optimizer's update are left out). It depends on shapes only: counted
    on tensors without data (the meta device; on the CPU, with zeros, for a model the meta device
    cannot run), the model and torch's random state untouched."""
    try:
        return _counted(model, sample, batch_size, "meta")
    except (NotImplementedError, RuntimeError):  # a user's model that reads values (.item(), data-dependent shapes)
        return _counted(model, sample, batch_size, "cpu")


def _counted(model: nn.Module, sample: torch.Tensor, batch_size: int, device: str) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.random.fork_rng(devices=[]):
        alone = copy.deepcopy(model).to(device)
        x = torch.zeros((batch_size, *sample.shape), dtype=sample.dtype, device=device)
        with FlopCounterMode(display=False) as counter:
            outputs = alone(x)
            targets = torch.zeros(outputs.shape[:-1], dtype=torch.int64, device=device)
            F.cross_entropy(outputs.flatten(0, -2), targets.flatten()).backward()
    return int(counter.get_total_flops())
