"""DP-SGD on the batched engine: each node's budget and noise generator (the same as a
process-engine node's: ``privacy.budget``, ``privacy.dpsgd.noise_generator``), and the noise added
to the clipped gradient sums ``NodeModels`` makes (``clip``)."""

from __future__ import annotations

import torch

from meshlearn.privacy.budget import PrivacyBudget
from meshlearn.privacy.dpsgd import noise_generator, noisy_mean


class BatchedPrivacy:
    """The DP-SGD of a block of nodes (rows ``0..len(budgets)``, ranks from ``first``)."""

    def __init__(self, budgets: list[PrivacyBudget], generators: list[torch.Generator], batch_size: int):
        self.budgets, self.generators, self.batch_size = budgets, generators, batch_size
        self.steps = [0] * len(budgets)

    @classmethod
    def of(cls, config, shard_sizes: list[int], first: int, device: torch.device, total_steps: int) -> BatchedPrivacy:
        """The block's nodes' DP-SGD under ``config.dp``: ``shard_sizes`` examples each, ranks from ``first``."""
        return cls([PrivacyBudget.of(config.dp, config.batch_size, size, total_steps) for size in shard_sizes],
                   [noise_generator(config.seed, first + row, device, seeded=config.dp.seeded)
                    for row in range(len(shard_sizes))],
                   config.batch_size)

    def noise(self, rows: torch.Tensor, sums: torch.Tensor) -> None:
        """In place: each of ``rows``' clipped gradient sums (``sums`` [n, P], in that order) noised and
        over the batch, as the process engine's node does (``privacy.dpsgd.noisy_mean``)."""
        for k, row in enumerate(rows.tolist()):
            budget = self.budgets[row]
            noisy_mean(sums[k], budget.noise_multiplier, budget.settings.max_grad_norm, self.batch_size,
                       self.generators[row])
            self.steps[row] += 1

    def reports(self) -> list[dict[str, float]]:
        """Each node's ``PrivacyBudget.report`` after the steps it took."""
        return [budget.report(steps) for budget, steps in zip(self.budgets, self.steps)]
