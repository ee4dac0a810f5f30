"""DP-SGD's gradient (Abadi et al. 2016) for both engines: each example's gradient by ``torch.func``
(``vmap`` of ``grad`` over the batch, so no per-example loop), clipped to ``max_grad_norm`` over all
parameters, summed; then Gaussian noise of ``noise_multiplier * max_grad_norm`` added to the sum,
divided by the batch size. A process-engine node calls ``clipped_gradient`` on its model; the
batched engine ``vmap``s ``clipped_sum`` over its nodes' rows; the DP-SGD mechanism
(``privacy.mechanisms``) adds the noise to either. Noise comes from each node's own generator, seeded from
the run's seed and its rank, so a node draws the same noise in either engine.

Noise and the batches a node samples must be secret: an adversary who can draw them again could
subtract the noise. Both come from the operating system's randomness unless the ``dp`` setting says
``seeded=true`` (reproducible runs for experiments, and both engines alike, with no privacy against
whoever knows the seed).

Per-example gradients need a model whose output for an example depends on that example only:
BatchNorm (training mode) mixes the batch, so a model holding it is refused (``check_model``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.functional import cross_entropy

from meshlearn.errors import ConfigError

LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
NOISE_SALT = 0xD9  # a node's noise generator's seed: (seed, rank, this)
_TINY = 1e-6


def check_model(model: nn.Module, name: str = "the model") -> None:
    """A ConfigError where ``model`` cannot have per-example gradients (BatchNorm)."""
    if any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        raise ConfigError(f"dp needs per-example gradients, which BatchNorm's batch statistics forbid: {name} holds "
                          "BatchNorm; use a model without it (mlp, lenet, simplecnn, gpt-tiny), or dp none")


def noise_generator(seed: int, rank: int, device: torch.device | str = "cpu", seeded: bool = True) -> torch.Generator:
    """Node ``rank``'s noise generator: from the run's ``seed`` where ``seeded`` (the same in both
    engines, and known to whoever knows the seed), else from the operating system's secret randomness."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + rank * 7919 + NOISE_SALT) % (2 ** 63) if seeded else secret_seed())
    return generator


def secret_seed() -> int:
    """A 63-bit seed from the operating system's secret randomness (DP's noise and sampling)."""
    import secrets

    return secrets.randbits(63)


class PrivateGradients:
    """Clipped sums of per-example gradients of one model template (``model``, whose parameters and
    buffers each call passes in), under the task's loss ``loss_of`` (the mean over a batch)."""

    def __init__(self, model: nn.Module, max_grad_norm: float, loss_of: LossOf | None = None):
        check_model(model)
        self.model = model
        self.names = [name for name, _ in model.named_parameters()]  # in the order of a flat parameter row
        self.max_grad_norm = max_grad_norm
        self.loss_of = loss_of or cross_entropy
        self._per_example = vmap(grad_and_value(self._loss), in_dims=(None, None, 0, 0), randomness="different")
        self.over_nodes = vmap(self.clipped_sum, in_dims=(0, 0, 0, 0), randomness="different")

    def _loss(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_of(functional_call(self.model, (params, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

    def clipped_sum(self, params: dict, buffers: dict, x: torch.Tensor, y: torch.Tensor
                    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """The sum over the batch (``x`` [B, ...], ``y`` [B]) of each example's gradient clipped to
        ``max_grad_norm`` (by parameter name), and the batch's mean loss."""
        grads, losses = self._per_example(params, buffers, x, y)
        squares = [g.reshape(g.shape[0], -1).pow(2).sum(1) for g in grads.values()]
        norms = torch.stack(squares, 1).sum(1).sqrt()
        factors = (self.max_grad_norm / (norms + _TINY)).clamp(max=1.0)
        return {name: torch.tensordot(factors, g, dims=1) for name, g in grads.items()}, losses.mean()


def noisy_mean(sums: torch.Tensor, noise_multiplier: float, max_grad_norm: float, batch_size: int,
               generator: torch.Generator) -> torch.Tensor:
    """In place: the clipped gradients' sum ``sums`` [P] plus Gaussian noise of standard deviation
    ``noise_multiplier * max_grad_norm``, over ``batch_size`` (the expected batch)."""
    noise = torch.randn(sums.shape, generator=generator, dtype=sums.dtype, device=sums.device)
    return sums.add_(noise, alpha=noise_multiplier * max_grad_norm).div_(batch_size)


def clipped_gradient(model: nn.Module, names: list[str], gradients: PrivateGradients, x: torch.Tensor,
                     y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A process-engine node's clipped sum of per-example gradients of ``model`` on the batch, as
    one row [1, P] (its parameters ``names``, in the order of the flat vector its optimizer
    updates), and the batch's mean loss."""
    model.train()
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b for name, b in model.named_buffers()}
    sums, loss = gradients.clipped_sum(params, buffers, x, y)
    return torch.cat([sums[name].reshape(-1) for name in names]).unsqueeze(0), loss


def private_step(model: nn.Module, names: list[str], gradients: PrivateGradients, optimizer, x: torch.Tensor,
                 y: torch.Tensor, noise_multiplier: float, batch_size: int, generator: torch.Generator
                 ) -> torch.Tensor:
    """One DP-SGD step of a process-engine node's ``model``: its ``clipped_gradient``, noised and
    over the batch (``noisy_mean``), then ``optimizer``'s update; the batch's mean loss."""
    flat, loss = clipped_gradient(model, names, gradients, x, y)
    noisy_mean(flat[0], noise_multiplier, gradients.max_grad_norm, batch_size, generator)
    optimizer.step(flat)
    return loss
