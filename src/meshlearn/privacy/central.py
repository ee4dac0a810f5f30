"""Central differential privacy of a leader's aggregate (DP-FedAvg, McMahan et al. 2018, with fixed
clipping, as Flower's server-side fixed clipping): each member clips its update over a cycle (its
model minus the model the cycle started from) to norm ``clip``; the leader adds Gaussian noise of
standard deviation ``noise_multiplier * clip / count`` to the mean of the ``count`` clipped models.
Replacing one member's update by none (zero-out adjacency, the count fixed by who takes part)
changes the mean by at most ``clip / count``, so the noise makes each cycle a Gaussian mechanism
over members; the accountant (``privacy.accountant``) adds the cycles up, each taking every member
(the draws are public: no amplification by sampling is claimed). Only the parameters are clipped and
noised (the first ``params`` values of a state; buffers such as BatchNorm's statistics are not).
"""

from __future__ import annotations

import torch

from meshlearn.privacy.accountant import epsilon

CENTRAL_SALT = 0xCE


def clip_update(state: torch.Tensor, start: torch.Tensor, params: int, clip: float) -> torch.Tensor:
    """In place: ``state``'s parameters moved back toward ``start`` so the update is at most ``clip`` long."""
    update = state[:params] - start[:params]
    norm = float(update.norm())
    if norm > clip:
        state[:params] = start[:params] + update * (clip / norm)
    return state


def noised(aggregate: torch.Tensor, params: int, noise_multiplier: float, clip: float, count: int,
           generator: torch.Generator) -> torch.Tensor:
    """``aggregate`` (a copy) with Gaussian noise of ``noise_multiplier * clip / count`` on its parameters."""
    noisy = aggregate.clone()
    noise = torch.randn(params, generator=generator, dtype=noisy.dtype)
    noisy[:params] += noise * (noise_multiplier * clip / max(1, count))
    return noisy


def leader_generator(seed: int, seeded: bool) -> torch.Generator:
    """A leader's noise generator: from the operating system's secret randomness, or (``seeded``, for
    experiments) from the run's seed."""
    from meshlearn.privacy.dpsgd import secret_seed

    generator = torch.Generator()
    generator.manual_seed((seed * 1_000_003 + CENTRAL_SALT) % (2 ** 63) if seeded else secret_seed())
    return generator


def central_report(noise_multiplier: float, clip: float, delta: float, fraction: float, cycles: int) -> dict:
    """The epsilon a member spent over ``cycles`` noised aggregates. Every cycle counts as taking it
    (sample rate 1): the leader's draws (``fraction``) follow from the run's seed, which is no secret,
    so no amplification by sampling is claimed."""
    return {"epsilon": epsilon(noise_multiplier, 1.0, cycles, delta), "delta": delta,
            "noise_multiplier": noise_multiplier, "clip": clip, "cycles": cycles, "fraction": fraction}
