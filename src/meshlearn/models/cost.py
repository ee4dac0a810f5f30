"""What one local SGD step of a model costs: its floating-point operations, counted once from its
shapes (the batched engine's default model of compute time, the same on any machine), and the
memory its backward pass keeps per sample (how the batched engine sizes a vectorized call, and a
network task's memory estimate)."""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry


def step_flops(model: nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """Floating-point operations of one training step of ``model`` on a batch of ``batch_size``
    inputs like ``sample`` (one input as the model reads it: its shape and dtype): the matrix
    products and convolutions of the forward pass and of the backward pass of the cross-entropy
    loss, as ``torch.utils.flop_counter.FlopCounterMode`` counts them (elementwise work and the
    optimizer's update are left out). It depends on shapes only: counted on the CPU from zeros, the
    counted products not computed (their results zeros of their shapes), the model and torch's
    random state untouched. Neither the meta device nor ``FlopCounterMode`` is used: both import
    ``torch._dynamo`` (about a second)."""
    try:
        return _counted(model, sample, batch_size, skip_work=True)
    except (NotImplementedError, RuntimeError):  # a user's model that fails on zeros where real products are due
        return _counted(model, sample, batch_size, skip_work=False)


def _counted(model: nn.Module, sample: torch.Tensor, batch_size: int, skip_work: bool) -> int:
    with torch.random.fork_rng(devices=[]):
        alone = copy.deepcopy(model).cpu()
        x = torch.zeros((batch_size, *sample.shape), dtype=sample.dtype)
        with _FlopCount(skip_work) as counter:
            outputs = alone(x)
            targets = torch.zeros(outputs.shape[:-1], dtype=torch.int64)
            F.cross_entropy(outputs.flatten(0, -2), targets.flatten()).backward()
    return counter.flops


class _FlopCount(TorchDispatchMode):
    """Sums the FLOPs of the operators torch runs while it is entered, as ``FlopCounterMode``
    does: an operator torch can decompose is decomposed (its parts counted), the rest counted by
    ``flop_registry``'s formula for them, if any. ``skip_work``: a product or convolution
    ``_RESULT_SHAPES`` knows is not computed, its result zeros of its shape. No per-module table,
    and unlike ``FlopCounterMode``'s, this mode's dispatch is not wrapped for ``torch.compile``,
    so ``torch._dynamo`` stays unimported."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # never compiled: torch's wrapping of a mode's __torch_dispatch__ imports torch._dynamo

    def __init__(self, skip_work: bool) -> None:
        super().__init__()
        self.skip_work = skip_work
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        packet = func._overloadpacket
        shapes = _RESULT_SHAPES.get(packet) if self.skip_work and not kwargs else None
        out = func(*args, **kwargs) if shapes is None else _zeros_like_results(shapes(*args), args)
        formula = flop_registry.get(packet)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def _product_shape(*args) -> tuple[int, ...]:
    """mm(a, b), addmm(c, a, b), bmm(a, b), baddbmm(c, a, b)'s result: a's rows by b's columns."""
    a, b = [arg for arg in args if isinstance(arg, torch.Tensor)][-2:]
    return (*a.shape[:-1], b.shape[-1])


def _convolution_shape(x, weight, _bias, stride, padding, dilation, transposed, output_padding, groups
                       ) -> tuple[int, ...]:
    """aten.convolution's result: x's batch, the output channels, each spatial size as torch computes it."""
    sizes = []
    for i, size in enumerate(x.shape[2:]):
        s, p, d, k = _at(stride, i), _at(padding, i), _at(dilation, i), weight.shape[2 + i]
        if transposed:
            sizes.append((size - 1) * s - 2 * p + d * (k - 1) + _at(output_padding, i) + 1)
        else:
            sizes.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
    channels = weight.shape[1] * groups if transposed else weight.shape[0]
    return (x.shape[0], channels, *sizes)


def _convolution_backward_shapes(_grad, x, weight, bias_sizes, *rest) -> tuple:
    """aten.convolution_backward's results: the input's, the weight's and the bias's gradients
    (each None where its ``output_mask`` entry is off)."""
    mask = rest[-1]
    shapes = (tuple(x.shape), tuple(weight.shape), tuple(bias_sizes) if bias_sizes is not None else None)
    return tuple(shape if wanted else None for shape, wanted in zip(shapes, mask))


def _at(values, i: int) -> int:
    """The ``i``-th of a convolution's per-dimension values (one value: the same for all)."""
    return values[i] if len(values) > 1 else values[0]


def _zeros_like_results(shapes, args) -> torch.Tensor | tuple:
    """Zeros of a skipped operator's result shape(s), in its first tensor argument's dtype and device."""
    like = next(arg for arg in args if isinstance(arg, torch.Tensor))
    if isinstance(shapes[0], int):
        return torch.zeros(shapes, dtype=like.dtype, device=like.device)
    return tuple(None if shape is None else torch.zeros(shape, dtype=like.dtype, device=like.device)
                 for shape in shapes)


aten = torch.ops.aten
# the operators whose work skip_work skips, by their result shapes (the costly ones a CPU step runs)
_RESULT_SHAPES = {aten.mm: _product_shape, aten.addmm: _product_shape, aten.bmm: _product_shape,
                  aten.baddbmm: _product_shape, aten.convolution: _convolution_shape,
                  aten.convolution_backward: _convolution_backward_shapes}


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
