"""Seeded partitioners: which training samples each node holds."""

from __future__ import annotations

import itertools
import operator
import random

import numpy as np

from meshlearn.errors import DatasetError
from meshlearn.suggest import did_you_mean

SPECS = "iid, shards:K, kshard:K, dirichlet:ALPHA, writers"
# each partition's name and its argument: (the kind of number, what it must be), or None where it takes none
ARGUMENTS = {"iid": None, "shards": (int, "K must be a whole number >= 1"), "kshard": (int, "K must be a whole number >= 1"),
             "dirichlet": (float, "ALPHA must be a number > 0"), "writers": None}
# how many times dirichlet draws its shares afresh before it gives up on every node holding a sample
DIRICHLET_DRAWS = 100


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


class Partition:
    """Which training samples each node holds, for any number of nodes, without an array per node:
    ``order`` holds every part's sample indices, part after part, each part ascending, and part
    ``k`` is ``order[offsets[k]:offsets[k + 1]]``. It reads as a list of index arrays: ``len``,
    iteration, ``p[k]`` (a read-only view into ``order``, no copy) and ``p[a:b]`` (a Partition of
    those parts, sharing ``order``). It keeps the arrays it is given (no copy) and makes them read-only."""

    def __init__(self, order: np.ndarray, offsets: np.ndarray):
        order, offsets = np.asarray(order, dtype=np.int64), np.asarray(offsets, dtype=np.int64)
        if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(order) \
                or (np.diff(offsets) < 0).any():
            raise ValueError(f"a Partition's offsets must rise from 0 to the {len(order)} indices it holds")
        order.flags.writeable = False
        offsets.flags.writeable = False
        self.order, self.offsets = order, offsets

    @property
    def sizes(self) -> np.ndarray:
        """Each part's number of samples."""
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            if step != 1:
                raise TypeError("a Partition slices a run of parts (p[a:b]), not with a step")
            stop = max(start, stop)
            first, last = self.offsets[start], self.offsets[stop]
            return Partition(self.order[first:last], self.offsets[start:stop + 1] - first)
        k = range(len(self))[operator.index(key)]  # an IndexError past the end, as a list's
        return self.order[self.offsets[k]:self.offsets[k + 1]]

    def __iter__(self):
        for k in range(len(self)):
            yield self[k]

    def __repr__(self) -> str:
        return f"Partition({len(self)} parts, {len(self.order)} samples)"


def _from_owners(owners: np.ndarray, n_parts: int) -> Partition:
    """The Partition in which sample ``i`` is in part ``owners[i]`` (``n_parts``: in none, as
    kshard's leftovers): one stable sort (each part's indices come out ascending) and a count per part."""
    counts = np.bincount(owners, minlength=n_parts + 1)[:n_parts]
    offsets = np.zeros(n_parts + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return Partition(np.argsort(owners, kind="stable")[:offsets[-1]], offsets)


def _even_sizes(total: int, pieces: int) -> np.ndarray:
    """The sizes ``np.array_split`` cuts ``total`` items into: the first ``total % pieces`` one larger."""
    size, larger = divmod(total, pieces)
    sizes = np.full(pieces, size, dtype=np.int64)
    sizes[:larger] += 1
    return sizes


def _owner_dtype(n_parts: int) -> type:
    """The smallest integer type of an owners array over ``n_parts`` parts (half the memory of int64)."""
    return np.int32 if n_parts < np.iinfo(np.int32).max else np.int64


def _iid(labels: np.ndarray, n_parts: int, rng: np.random.Generator) -> Partition:
    """A seeded permutation of the samples, cut into ``n_parts`` near-equal runs."""
    owners = np.empty(len(labels), dtype=_owner_dtype(n_parts))
    owners[rng.permutation(len(labels))] = np.repeat(np.arange(n_parts, dtype=owners.dtype),
                                                     _even_sizes(len(labels), n_parts))
    return _from_owners(owners, n_parts)


def _shards(labels: np.ndarray, n_parts: int, k: int, rng: np.random.Generator) -> Partition:
    """McMahan et al.'s (2017) pathological non-IID split: label-sorted data cut into n*K equal
    shards, K random shards per node; every sample is used."""
    if len(labels) < n_parts * k:
        raise DatasetError(f"shards:{k}: {len(labels)} samples cannot make {n_parts * k} shards; lower K")
    dtype = _owner_dtype(n_parts)
    shard_owner = np.empty(n_parts * k, dtype=dtype)
    shard_owner[rng.permutation(n_parts * k)] = np.arange(n_parts * k, dtype=dtype) // k  # node i: K shards
    owners = np.empty(len(labels), dtype=dtype)
    owners[np.argsort(labels, kind="stable")] = np.repeat(shard_owner, _even_sizes(len(labels), n_parts * k))
    return _from_owners(owners, n_parts)


def _kshard(labels: np.ndarray, n_parts: int, k: int, seed: int) -> Partition:
    """DecentralizePy's ``KShardDataPartitioner`` (``partition_niid = kshard``), draw for draw: the
    samples grouped by label (in their order within a label); node after node takes K runs of
    ``int(N / n) // K`` samples, each starting at a random place among those left (Python's
    ``random.Random(seed).randint``) and wrapping around. What is left over is used by no node."""
    order = np.argsort(labels, kind="stable").tolist()
    run = int((1.0 / n_parts) * len(order)) // k
    if run < 1:
        raise DatasetError(f"kshard:{k}: {len(order)} samples cannot give {n_parts} nodes {k} runs each; lower K")
    draw = random.Random(seed)
    owners = np.full(len(labels), n_parts, dtype=_owner_dtype(n_parts))  # n_parts: no node's
    for node in range(n_parts):
        part: list[int] = []
        for _ in range(k):
            start = draw.randint(0, len(order) - 1)
            if start + run > len(order):  # wraps around: the tail, then the head
                part += order[start:] + order[:start + run - len(order)]
                order = order[start + run - len(order):start]
            else:
                part += order[start:start + run]
                order = order[:start] + order[start + run:]
        owners[part] = node
    return _from_owners(owners, n_parts)


def _dirichlet(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator) -> Partition:
    """Per class, node shares drawn from Dirichlet(alpha): small alpha, few classes per node."""
    owners = _dirichlet_draws(labels, n_parts, alpha, rng)
    if owners is None:
        raise DatasetError(f"dirichlet:{alpha} left a node without samples in {DIRICHLET_DRAWS} draws "
                           f"({len(labels)} samples, {n_parts} nodes); use a larger ALPHA or fewer nodes")
    return _from_owners(owners, n_parts)


def _dirichlet_draws(labels: np.ndarray, n_parts: int, alpha: float, rng: np.random.Generator) -> np.ndarray | None:
    """Each sample's node in the first of ``DIRICHLET_DRAWS`` draws that gives every node a sample
    (None if none does)."""
    by_label = np.argsort(labels, kind="stable")  # each class's members, ascending, one run per class
    bounds = np.concatenate([[0], np.cumsum(np.unique(labels, return_counts=True)[1])])
    for _ in range(DIRICHLET_DRAWS):
        owners = _dirichlet_owners(by_label, bounds, n_parts, alpha, rng)
        if np.bincount(owners, minlength=n_parts).all():
            return owners
    return None


def _dirichlet_owners(by_label: np.ndarray, bounds: np.ndarray, n_parts: int, alpha: float,
                      rng: np.random.Generator) -> np.ndarray:
    """One draw: each sample's node. Class after class (its members ``by_label[bounds[c]:bounds[c + 1]]``),
    the members shuffled and cut at the running sums of shares drawn from Dirichlet(alpha): node i
    takes the i-th piece, as ``np.split`` at those cuts gives it."""
    owners = np.empty(len(by_label), dtype=_owner_dtype(n_parts))
    nodes, shares = np.arange(n_parts, dtype=owners.dtype), np.full(n_parts, alpha)
    for first, last in itertools.pairwise(bounds):
        members = rng.permutation(by_label[first:last])
        cuts = np.minimum((np.cumsum(rng.dirichlet(shares))[:-1] * len(members)).astype(int), len(members))
        owners[members] = np.repeat(nodes, np.diff(cuts, prepend=0, append=len(members)))
    return owners


def _writers(groups: np.ndarray, n_parts: int) -> Partition:
    """LEAF's natural split (DecentralizePy's FEMNIST): the writers, in their files' order, cut into
    ``n_parts`` contiguous blocks; a node holds every sample of its writers."""
    writers, writer_of_sample = np.unique(groups, return_inverse=True)
    if len(writers) < n_parts:
        raise DatasetError(f"partition writers: {len(writers)} writers cannot be shared by {n_parts} nodes; "
                           "use fewer nodes")
    block_of_writer = np.repeat(np.arange(n_parts, dtype=_owner_dtype(n_parts)), _even_sizes(len(writers), n_parts))
    return _from_owners(block_of_writer[writer_of_sample.reshape(-1)], n_parts)


def partition(labels: np.ndarray, n_parts: int, spec: str, seed: int, groups=None) -> Partition:
    """Disjoint index arrays (sorted), one per node, covering every sample (but for ``kshard``'s
    leftovers), as a Partition; same seed, same split. ``groups`` (a dataset's ``train_groups``:
    each sample's writer) serve the ``writers`` partition. Time and memory grow with the samples
    (and an integer per node), so it serves populations of 10^5 nodes."""
    labels = np.asarray(labels)
    if n_parts < 1 or n_parts > len(labels):
        raise DatasetError(f"cannot split {len(labels)} samples among {n_parts} nodes")
    rng = np.random.default_rng(seed)
    name, arg = parse_partition(spec)
    if name == "iid":
        return _iid(labels, n_parts, rng)
    if name == "shards":
        return _shards(labels, n_parts, int(arg), rng)
    if name == "kshard":
        return _kshard(labels, n_parts, int(arg), seed)
    if name == "writers":
        if groups is None:
            raise DatasetError("partition writers needs a dataset of writers (leaf:DIR); this one has none")
        return _writers(np.asarray(groups), n_parts)
    return _dirichlet(labels, n_parts, float(arg), rng)


def partition_dataset(dataset, n_parts: int, spec: str, seed: int) -> Partition:
    """``partition`` of a Dataset's training samples (with its writers, where it has them). A text
    corpus's windows have no class label: they are dealt out at random (``iid``) or by file
    (``writers``)."""
    groups = getattr(dataset, "train_groups", None)
    if getattr(dataset, "tokens", False) and spec not in ("iid", "writers"):
        raise DatasetError(f"partition {spec} splits by class label, which text has none of: use iid (windows dealt "
                           "out at random) or writers (whole files per node)")
    return partition(dataset.train_y.numpy(), n_parts, spec, seed, None if groups is None else groups.numpy())
