"""The privacy accountant of DP-SGD: Rényi differential privacy of the sampled Gaussian mechanism
(Mironov, Talwar and Zhang 2019), turned into (epsilon, delta) by Balle et al. 2020's conversion.

A step samples each of a node's examples with probability ``sample_rate`` (the batch over the shard),
clips each example's gradient to a norm and adds Gaussian noise of ``noise_multiplier`` times that
norm. Over integer orders alpha the step's RDP is log(A_alpha) / (alpha - 1), where

    A_alpha = sum_k C(alpha, k) (1 - q)^(alpha - k) q^k exp((k^2 - k) / (2 sigma^2)),

RDP adds up over steps, and epsilon is the least over the orders of
``rdp - (log(delta) + log(alpha)) / (alpha - 1) + log((alpha - 1) / alpha)``. This is Opacus' RDP
accountant's arithmetic on integer orders (tests/test_dp.py checks ours against it, order for
order): Opacus adds fractional orders below 11, which can give an epsilon a few percent lower.

Pure (numpy and math only): node processes use it without importing Opacus (or ``torch.optim``).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from meshlearn.errors import ConfigError

ORDERS = tuple(range(2, 257))  # integer Rényi orders alpha
MAX_NOISE = 1e4


def _log_a(q: float, sigma: float, alpha: int) -> float:
    """log A_alpha of the sampled Gaussian mechanism (integer ``alpha``), summed in log space."""
    k = np.arange(alpha + 1, dtype=np.float64)
    log_binomial = math.lgamma(alpha + 1) - np.array([math.lgamma(i + 1) + math.lgamma(alpha - i + 1)
                                                      for i in range(alpha + 1)])
    terms = log_binomial + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma * sigma)
    top = terms.max()
    return float(top + math.log(np.exp(terms - top).sum()))


def rdp(noise_multiplier: float, sample_rate: float, steps: int, orders: tuple[int, ...] = ORDERS) -> np.ndarray:
    """The RDP of ``steps`` steps at each of ``orders``."""
    if noise_multiplier <= 0:
        return np.full(len(orders), math.inf)
    if sample_rate <= 0 or steps <= 0:
        return np.zeros(len(orders))
    if sample_rate >= 1:
        per_step = np.array([alpha / (2 * noise_multiplier ** 2) for alpha in orders])
    else:
        per_step = np.array([_log_a(sample_rate, noise_multiplier, alpha) / (alpha - 1) for alpha in orders])
    return per_step * steps


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float,
            orders: tuple[int, ...] = ORDERS) -> float:
    """The epsilon spent after ``steps`` steps, at ``delta`` (0 before any step; inf without noise)."""
    if steps <= 0 or sample_rate <= 0:
        return 0.0
    spent = rdp(noise_multiplier, sample_rate, steps, orders)
    alphas = np.array(orders, dtype=np.float64)
    eps = spent - (math.log(delta) + np.log(alphas)) / (alphas - 1) + np.log((alphas - 1) / alphas)
    return float(max(0.0, np.nanmin(eps)))


@functools.lru_cache(maxsize=1024)  # nodes of equal shards ask the same
def noise_multiplier_for(target: float, delta: float, sample_rate: float, steps: int) -> float:
    """The least noise multiplier (to 0.01 %) whose ``steps`` steps spend at most ``target`` epsilon;
    a ConfigError where even ``MAX_NOISE`` spends more."""
    if epsilon(MAX_NOISE, sample_rate, steps, delta) > target:
        raise ConfigError(f"dp epsilon={target:g} cannot be met in {steps} steps at sample rate {sample_rate:.3g}: ask "
                          "for a larger epsilon, or fewer steps")
    low, high = 0.0, 1.0
    while epsilon(high, sample_rate, steps, delta) > target:
        low, high = high, high * 2
    while high - low > 1e-4 * high:
        middle = (low + high) / 2
        if epsilon(middle, sample_rate, steps, delta) > target:
            low = middle
        else:
            high = middle
    return high
