"""The synthetic federated data set of the FedProx paper (Li et al. 2020), as LEAF generates it:
``synthetic:ALPHA,BETA``, one user per node, drawn from the run's seed (nothing to download).

User k has a linear softmax model of its own (W, b drawn around a mean of spread ALPHA) and inputs
of its own (centred on a mean of spread BETA). ALPHA moves all of W and b by one amount, which adds
the same to every class's logit: it changes no label (as in the paper's generator). Every user is
generated from the seed and its index alone, so a population of 100,000 users costs only its size
table until a user is asked for (``SyntheticPopulation``);
``load_synthetic`` holds every user's samples at once, for the engines that need them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from meshlearn.data.datasets import Dataset
from meshlearn.data.specs import parse_synthetic
from meshlearn.errors import DatasetError

DIM = 60  # features of a sample
CLASSES = 10  # labels 0..9: the argmax of the user's linear model
MAX_USER_SAMPLES = 1000  # a user's train and test samples together, at most
TEST_USERS = 200  # the run's test set: the test samples of these first users
SALT = 0x5EED  # keeps the generator's draws apart from the run's other draws of the same seed
SIZE_MEAN, SIZE_SIGMA = 4.0, 2.0  # a user's sample count: lognormal(mean, sigma) of these (LEAF's)
MIN_USER_SAMPLES = 50  # added to every user's lognormal count
TEST_EVERY = 10  # a user's last tenth of samples (count // 10) are its test samples: LEAF's 90/10
SIGMA = np.arange(1, DIM + 1, dtype=np.float64) ** -1.2  # the inputs' covariance (diagonal): feature j, j^-1.2
SHAPE = (1, 1, DIM)  # one sample as meshlearn's models read it: a one-channel 1 x 60 image
MAX_MATERIALIZED = 5_000_000  # train samples a dataset holds at once (1.2 GB of float32); more: users on demand


@dataclass(frozen=True)
class SyntheticPopulation:
    """The users of ``synthetic:ALPHA,BETA`` for ``users`` nodes and ``seed``: their sample counts,
    and any one user's samples generated when asked for (never another user's). User k is the same
    in every population of more than k users; the test set the same in every one of at least
    ``TEST_USERS``."""

    alpha: float
    beta: float
    users: int
    seed: int

    def __post_init__(self) -> None:
        for name, value in (("ALPHA", self.alpha), ("BETA", self.beta)):
            if not np.isfinite(value) or value < 0:
                raise DatasetError(f"synthetic {name} {value}: must be a number >= 0 (e.g. synthetic:1,1)")
        if self.users < 1 or self.seed < 0:
            raise DatasetError(f"synthetic data needs at least one user and a seed >= 0; got {self.users} users, "
                               f"seed {self.seed}")

    @cached_property
    def totals(self) -> np.ndarray:
        """Each user's train and test samples together (np.int64 [users], read-only)."""
        drawn = np.random.default_rng([self.seed, SALT, 0]).lognormal(SIZE_MEAN, SIZE_SIGMA, self.users)
        totals = np.minimum(drawn.astype(np.int64) + MIN_USER_SAMPLES, MAX_USER_SAMPLES)
        totals.setflags(write=False)
        return totals

    @cached_property
    def sizes(self) -> np.ndarray:
        """Each user's training samples (np.int64 [users], read-only): what FedAvg weighs it by."""
        sizes = self.totals - self.totals // TEST_EVERY
        sizes.setflags(write=False)
        return sizes

    @property
    def train_samples(self) -> int:
        """Every user's training samples together."""
        return int(self.sizes.sum())

    @property
    def name(self) -> str:
        """What reports call the data set: ``synthetic(1,1)``."""
        return f"synthetic({self.alpha:g},{self.beta:g})"

    def user(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """User k's samples, train then test: x float32 [n, 60], y int64 [n] (the exact generator
        that other implementations of this data set share, bit for bit)."""
        if not 0 <= k < self.users:
            raise IndexError(f"user {k} of a population of {self.users}")
        rng = np.random.default_rng([self.seed, SALT, 1, int(k)])
        u = rng.normal(0.0, self.alpha)
        b_mean = rng.normal(0.0, self.beta)
        w = rng.normal(u, 1.0, (DIM, CLASSES))
        b = rng.normal(u, 1.0, CLASSES)
        v = rng.normal(b_mean, 1.0, DIM)
        x = rng.normal(0.0, 1.0, (int(self.totals[k]), DIM)) * np.sqrt(SIGMA) + v
        y = np.argmax(x @ w + b, axis=1)
        return x.astype(np.float32), y.astype(np.int64)

    def samples(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """User k's training samples, generated now: x float32 [n, 1, 1, 60], y int64 [n]."""
        x, y = self.user(k)
        return _tensors(x[:self.sizes[k]], y[:self.sizes[k]])

    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The run's test set: the test samples of users 0 .. min(users, TEST_USERS) - 1, user after user."""
        xs, ys = [], []
        for k in range(min(self.users, TEST_USERS)):
            x, y = self.user(k)
            xs.append(x[self.sizes[k]:])
            ys.append(y[self.sizes[k]:])
        return _tensors(np.concatenate(xs), np.concatenate(ys))


def _tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat samples as meshlearn reads them: x [n, 1, 1, 60] float32, y [n] int64."""
    return torch.from_numpy(np.ascontiguousarray(x).reshape(-1, *SHAPE)), torch.from_numpy(np.ascontiguousarray(y))


def load_synthetic(alpha: float, beta: float, users: int, seed: int, whole: bool = True) -> Dataset:
    """``synthetic:ALPHA,BETA`` for ``users`` nodes as a Dataset: every user's training samples,
    user after user, each sample's user in ``train_groups`` (``--partition writers``: node k holds
    user k), the test set of ``SyntheticPopulation.test_set``, and the population in ``population``.
    A population of more than ``MAX_MATERIALIZED`` training samples holds only its first
    ``TEST_USERS`` users' (``Dataset.population_only``): only FedAvg's cohort path, which generates
    each user when drawn, trains on it (``require_materialized`` refuses it elsewhere); so does a
    population loaded not ``whole`` (for that path, or for a test set), whatever its size."""
    population = SyntheticPopulation(float(alpha), float(beta), int(users), int(seed))
    kept = users if whole and population.train_samples <= MAX_MATERIALIZED else min(users, TEST_USERS)
    sizes = population.sizes[:kept]
    train_x = np.empty((int(sizes.sum()), DIM), dtype=np.float32)
    train_y = np.empty(len(train_x), dtype=np.int64)
    start = 0
    for k, size in enumerate(sizes.tolist()):
        x, y = population.user(k)
        train_x[start:start + size], train_y[start:start + size] = x[:size], y[:size]
        start += size
    test_x, test_y = population.test_set()
    return Dataset(name=population.name, train_x=torch.from_numpy(train_x.reshape(-1, *SHAPE)),
                   train_y=torch.from_numpy(train_y), test_x=test_x, test_y=test_y, num_classes=CLASSES,
                   class_names=tuple(str(c) for c in range(CLASSES)), mean=(0.0,), std=(1.0,),
                   train_groups=torch.from_numpy(np.repeat(np.arange(kept, dtype=np.int64), sizes)),
                   population=population)


def load_synthetic_spec(spec: str, users: int | None, seed: int, whole: bool = True) -> Dataset:
    """``load_synthetic`` of a ``synthetic:ALPHA,BETA`` spec; DatasetError where no node count is
    known (the data set has one user per node of a simulation)."""
    alpha, beta = parse_synthetic(spec)
    if users is None:
        raise DatasetError(f"{spec} generates one user per node of a simulation (meshlearn simulate --nodes N): "
                           "it is not a data set to share out here")
    return load_synthetic(alpha, beta, users, seed, whole)


def require_materialized(dataset: Dataset) -> None:
    """DatasetError where ``dataset`` holds only a sample of a generated population's users: an engine
    that trains on every node's samples cannot run it (FedAvg's cohort path generates users on demand)."""
    population = dataset.population
    if population is not None and dataset.population_only:
        raise DatasetError(f"{population.name} with {population.users:,} users holds {population.train_samples:,} "
                           f"training samples, more than the {MAX_MATERIALIZED:,} a run holds at once: use the "
                           "batched engine's FedAvg with --fedavg-cohort K (it generates each user only when "
                           "drawn), or fewer --nodes")
