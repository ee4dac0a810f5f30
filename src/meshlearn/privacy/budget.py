"""One node's DP-SGD bookkeeping, the same in both engines: its sample rate (the batch over its
shard), its noise multiplier (the ``dp`` setting's, or the one that spends its epsilon over the
node's steps), and the epsilon spent after a number of steps (``privacy.accountant``)."""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.privacy.accountant import epsilon
from meshlearn.privacy.settings import DPSettings


@dataclass(frozen=True)
class PrivacyBudget:
    """A node's DP-SGD parameters (see the module)."""

    settings: DPSettings
    sample_rate: float
    total_steps: int
    noise_multiplier: float

    @classmethod
    def of(cls, settings: DPSettings, batch_size: int, shard_size: int, total_steps: int) -> PrivacyBudget:
        """The budget of a node with ``shard_size`` examples, batches of ``batch_size`` and
        ``total_steps`` local steps in the run."""
        rate = min(1.0, batch_size / max(1, shard_size))
        return cls(settings, rate, total_steps, settings.noise_for(rate, total_steps))

    def epsilon(self, steps: int) -> float:
        """The epsilon spent after ``steps`` steps, at the setting's delta."""
        return epsilon(self.noise_multiplier, self.sample_rate, steps, self.settings.delta)

    def report(self, steps: int) -> dict[str, float]:
        """What a node says of its privacy after ``steps`` steps (its final event's ``privacy``)."""
        return {"epsilon": self.epsilon(steps), "delta": self.settings.delta,
                "noise_multiplier": self.noise_multiplier, "max_grad_norm": self.settings.max_grad_norm,
                "sample_rate": self.sample_rate, "steps": steps}


def privacy_summary(reports: list[dict[str, float]]) -> dict[str, float]:
    """The run's privacy from its nodes' ``report``s: the most epsilon any node spent, and the range of noise."""
    noises = [r["noise_multiplier"] for r in reports]
    return {"epsilon": max(r["epsilon"] for r in reports), "delta": reports[0]["delta"],
            "noise_multiplier_min": min(noises), "noise_multiplier_max": max(noises),
            "max_grad_norm": reports[0]["max_grad_norm"], "steps": max(r["steps"] for r in reports)}
