"""Seeded partitioners: which training samples each node holds."""

from __future__ import annotations

import random

import numpy as np

from meshlearn.errors import DatasetError
from meshlearn.suggest import did_you_mean

SPECS = "iid, shards:K, kshard:K, dirichlet:ALPHA, writers"
# each partition's name and its argument: (the kind of number, what it must be), or None where it takes none
ARGUMENTS = {"iid": None, "shards": (int, "K must be a whole number >= 1"), "kshard": (int, "K must be a whole number >= 1"),
             "dirichlet": (float, "ALPHA must be a number > 0"), "writers": None}


def parse_partition(spec: str) -> tuple[str, int | float | None]:
    """``"shards:2"`` -> ("shards", 2): the partition ``spec`` names and its argument (None where it
    takes none); a DatasetError saying what is wrong, before any data loads."""
    name, _, arg = spec.strip().partition(":")
    if name not in ARGUMENTS or bool(arg) != (ARGUMENTS[name] is not None):
        raise DatasetError(f"unknown partition {spec!r}: {did_you_mean(name, list(ARGUMENTS))}use one of {SPECS}")
    if ARGUMENTS[name] is None:
        return name, None
    kind, rule = ARGUMENTS[name]
    try:
        number = kind(arg)
    except ValueError:
        number = 0
    if not number > 0:
        raise DatasetError(rule, setting="partition", value=spec)
    return name, number


def _iid(labels: np.ndarray, n_parts: int, rng: np.random.Generator) -> list[np.ndarray]:
    return np.array_split(rng.permutation(len(labels)), n_parts)


def _shards(labels: np.ndarray, n_parts: int, k: int, rng: np.random.Generator) -> list[np.ndarray]:
    """McMahan et al.'s (2017) pathological non-IID split: label-sorted data cut into n*K equal
    shards, K random shards per node; every sample is used."""
    if len(labels) < n_parts * k:
        raise DatasetError(f"shards:{k}: {len(labels)} samples cannot make {n_parts * k} shards; lower K")
    order = np.argsort(labels, kind="stable")
    shards = np.array_split(order, n_parts * k)
    assignment = rng.permutation(n_parts * k)
    return [np.concatenate([shards[s] for s in assignment[i * k:(i + 1) * k]]) for i in range(n_parts)]


def _kshard(labels: np.ndarray, n_parts: int, k: int, seed: int) -> list[np.ndarray]:
    """DecentralizePy's ``KShardDataPartitioner`` (``partition_niid = kshard``), draw for draw: the
    samples grouped by label (in their order within a label); node after node takes K runs of
    ``int(N / n) // K`` samples, each starting at a random place among those left (Python's
    ``random.Random(seed).randint``) and wrapping around. What is left over is used by no node."""
    order = np.argsort(labels, kind="stable").tolist()
    run = int((1.0 / n_parts) * len(order)) // k
    if run < 1:
        raise DatasetError(f"kshard:{k}: {len(order)} samples cannot give {n_parts} nodes {k} runs each; lower K")
    draw = random.Random(seed)
    parts = []
    for _ in range(n_parts):
        part: list[int] = []
        for _ in range(k):
            start = draw.randint(0, len(order) - 1)
            if start + run > len(order):  # wraps around: the tail, then the head
                part += order[start:] + order[:start + run - len(order)]
                order = order[start + run - len(order):start]
            else:
                part += order[start:start + run]
                order = order[:start] + order[start + run:]
        parts.append(np.array(part, dtype=np.int64))
    return parts


def _dirichlet(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator) -> list[np.ndarray]:
    """Per class, node shares drawn from Dirichlet(alpha): small alpha, few classes per node."""
    for _ in range(100):
        parts: list[list[np.ndarray]] = [[] for _ in range(n_parts)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * n_parts))[:-1] * len(members)).astype(int)
            for i, piece in enumerate(np.split(members, cuts)):
                parts[i].append(piece)
        result = [np.concatenate(p) for p in parts]
        if all(len(p) > 0 for p in result):
            return result
    raise DatasetError(f"dirichlet:{alpha} left a node without samples in 100 draws; use a larger ALPHA")


def _writers(groups: np.ndarray, n_parts: int) -> list[np.ndarray]:
    """LEAF's natural split (DecentralizePy's FEMNIST): the writers, in their files' order, cut into
    ``n_parts`` contiguous blocks; a node holds every sample of its writers."""
    writers = np.unique(groups)
    if len(writers) < n_parts:
        raise DatasetError(f"partition writers: {len(writers)} writers cannot be shared by {n_parts} nodes; "
                           "use fewer nodes")
    return [np.flatnonzero(np.isin(groups, block)) for block in np.array_split(writers, n_parts)]


def partition(labels: np.ndarray, n_parts: int, spec: str, seed: int, groups=None) -> list[np.ndarray]:
    """Disjoint index arrays (sorted), one per node, covering every sample (but for ``kshard``'s
    leftovers); same seed, same split. ``groups`` (a dataset's ``train_groups``: each sample's
    writer) serve the ``writers`` partition."""
    labels = np.asarray(labels)
    if n_parts < 1 or n_parts > len(labels):
        raise DatasetError(f"cannot split {len(labels)} samples among {n_parts} nodes")
    rng = np.random.default_rng(seed)
    name, arg = parse_partition(spec)
    if name == "iid":
        parts = _iid(labels, n_parts, rng)
    elif name == "shards":
        parts = _shards(labels, n_parts, int(arg), rng)
    elif name == "kshard":
        parts = _kshard(labels, n_parts, int(arg), seed)
    elif name == "writers":
        if groups is None:
            raise DatasetError("partition writers needs a dataset of writers (leaf:DIR); this one has none")
        parts = _writers(np.asarray(groups), n_parts)
    else:
        parts = _dirichlet(labels, n_parts, float(arg), rng)
    return [np.sort(p).astype(np.int64) for p in parts]


def partition_dataset(dataset, n_parts: int, spec: str, seed: int) -> list[np.ndarray]:
    """``partition`` of a Dataset's training samples (with its writers, where it has them). A text
    corpus's windows have no class label: they are dealt out at random (``iid``) or by file
    (``writers``)."""
    groups = getattr(dataset, "train_groups", None)
    if getattr(dataset, "tokens", False) and spec not in ("iid", "writers"):
        raise DatasetError(f"partition {spec} splits by class label, which text has none of: use iid (windows dealt "
                           "out at random) or writers (whole files per node)")
    return partition(dataset.train_y.numpy(), n_parts, spec, seed, None if groups is None else groups.numpy())
