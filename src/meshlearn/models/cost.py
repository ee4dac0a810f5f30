"""What one local SGD step of a model costs: its floating-point operations, counted once from its
shapes (the batched engine's default model of compute time, the same on any machine), and the
memory its backward pass keeps per sample (how the batched engine sizes a vectorized call, and a
network task's memory estimate)."""

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


def saved_activation_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the tensors other than its parameters that ``model``'s forward pass on ``x`` keeps
    for the backward pass (a layer's inputs and outputs, a transformer's attention weights, B x heads
    x T x T), each counted once. Run in evaluation mode (batch norm's training mode needs two
    samples: give one), the model's mode and torch's random state left as they were."""
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[tuple[int, int], int] = {}  # each tensor the backward pass keeps, once: (address, bytes) -> bytes

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.data_ptr() not in weights:
            size = tensor.numel() * tensor.element_size()
            saved[(tensor.data_ptr(), size)] = size
        return tensor

    was_training = model.training
    try:
        model.eval()
        with torch.random.fork_rng(devices=[]), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            model(x)
    finally:
        model.train(was_training)
    return sum(saved.values())
