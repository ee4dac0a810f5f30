"""Partitions of large populations: one index array for every node (a ``Partition``), the same parts
as the list-of-arrays partitioners it replaced, in memory that grows with the samples only."""

import importlib
import random
import tracemalloc

import numpy as np
import pytest

from meshlearn.data import Partition, load_digits, partition, partition_dataset
from meshlearn.errors import DatasetError

partition_module = importlib.import_module("meshlearn.data.partition")  # the package's partition is the function

DIGITS = load_digits().train_y.numpy()
SPECS = ["iid", "shards:1", "shards:3", "kshard:1", "kshard:2", "dirichlet:0.1", "dirichlet:0.5", "dirichlet:10",
         "writers"]
# a population of the cross-device scale: 100,000 clients sharing a million samples of 10 classes
CLIENTS, SAMPLES, CLASSES = 100_000, 1_000_000, 10
# the most a scale partition may hold at once, in multiples of the samples' int64 labels: the
# owners, a permutation and the sorted order are a few such arrays; a Python array per client
# (about 100 bytes of object each, on 10 samples of 8 bytes) would not fit under it
PEAK_MULTIPLE = 3.5


# --- the reference: the partitioners as they were, a list of index arrays ---------------------------

def _reference(labels, n_parts, spec, seed, groups=None):
    rng = np.random.default_rng(seed)
    name, _, arg = spec.partition(":")
    if name == "iid":
        parts = np.array_split(rng.permutation(len(labels)), n_parts)
    elif name == "shards":
        k = int(arg)
        shards = np.array_split(np.argsort(labels, kind="stable"), n_parts * k)
        assignment = rng.permutation(n_parts * k)
        parts = [np.concatenate([shards[s] for s in assignment[i * k:(i + 1) * k]]) for i in range(n_parts)]
    elif name == "kshard":
        parts = _reference_kshard(labels, n_parts, int(arg), seed)
    elif name == "writers":
        writers = np.unique(groups)
        parts = [np.flatnonzero(np.isin(groups, block)) for block in np.array_split(writers, n_parts)]
    else:
        parts = _reference_dirichlet(labels, n_parts, float(arg), rng)
    return [np.sort(p).astype(np.int64) for p in parts]


def _reference_kshard(labels, n_parts, k, seed):
    order = np.argsort(labels, kind="stable").tolist()
    run = int((1.0 / n_parts) * len(order)) // k
    draw = random.Random(seed)
    parts = []
    for _ in range(n_parts):
        part = []
        for _ in range(k):
            start = draw.randint(0, len(order) - 1)
            if start + run > len(order):
                part += order[start:] + order[:start + run - len(order)]
                order = order[start + run - len(order):start]
            else:
                part += order[start:start + run]
                order = order[:start] + order[start + run:]
        parts.append(np.array(part, dtype=np.int64))
    return parts


def _reference_dirichlet(labels, n_parts, alpha, rng):
    for _ in range(100):
        parts = [[] for _ in range(n_parts)]
        for label in np.unique(labels):
            members = rng.permutation(np.flatnonzero(labels == label))
            cuts = (np.cumsum(rng.dirichlet([alpha] * n_parts))[:-1] * len(members)).astype(int)
            for i, piece in enumerate(np.split(members, cuts)):
                parts[i].append(piece)
        result = [np.concatenate(p) for p in parts]
        if all(len(p) > 0 for p in result):
            return result
    raise AssertionError("the reference left a node empty: pick a case that fills every node")


def _same_parts(partition_, reference):
    return len(partition_) == len(reference) and all(
        a.dtype == np.int64 and np.array_equal(a, b) for a, b in zip(partition_, reference))


# --- the same parts as before ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n_parts,seed", [(1, 0), (3, 90), (10, 4), (37, 1)])
def test_a_partition_holds_the_parts_the_list_of_arrays_held(spec, n_parts, seed):
    groups = np.random.default_rng(3).integers(0, 60, len(DIGITS))  # 60 writers, in no order
    reference = _reference(DIGITS, n_parts, spec, seed, groups)
    parts = partition(DIGITS, n_parts, spec, seed, groups)
    assert isinstance(parts, Partition) and _same_parts(parts, reference)
    assert parts.sizes.tolist() == [len(p) for p in reference]


@pytest.mark.parametrize("spec,n_parts,seed", [("iid", 1500, 2), ("shards:2", 1500, 2), ("shards:2", 200, 7),
                                               ("dirichlet:0.3", 200, 7), ("dirichlet:0.3", 50, 1),
                                               ("dirichlet:5", 100, 3)])
def test_many_classes_and_parts_of_two_samples_match_too(spec, n_parts, seed):
    labels = np.random.default_rng(8).integers(0, 62, 3000)  # FEMNIST's 62 classes, a few dozen samples each
    assert _same_parts(partition(labels, n_parts, spec, seed), _reference(labels, n_parts, spec, seed))


def test_dirichlet_keeps_its_retries_draw_for_draw():
    """Small alpha over many nodes leaves some empty at first (here the 13th draw fills them all):
    the draw kept is the same one as before (the retries consume the generator as they did)."""
    labels = np.random.default_rng(5).integers(0, 4, 400)
    rng = np.random.default_rng(1)
    first = np.zeros(60, dtype=np.int64)
    for label in np.unique(labels):  # the first draw, by hand: some node is left empty
        members = rng.permutation(np.flatnonzero(labels == label))
        cuts = (np.cumsum(rng.dirichlet([0.5] * 60))[:-1] * len(members)).astype(int)
        first += [len(piece) for piece in np.split(members, cuts)]
    assert (first == 0).any()
    assert _same_parts(partition(labels, 60, "dirichlet:0.5", 1), _reference(labels, 60, "dirichlet:0.5", 1))


# --- what a Partition is -----------------------------------------------------------------------------

def test_a_part_is_a_read_only_view_of_the_one_order():
    parts = partition(DIGITS, 10, "dirichlet:0.5", seed=2)
    assert parts.order.dtype == np.int64 and parts.offsets.tolist()[0] == 0 and parts.offsets[-1] == len(DIGITS)
    assert sorted(parts.order.tolist()) == list(range(len(DIGITS)))  # every sample once
    for k, part in enumerate(parts):
        assert np.shares_memory(part, parts.order) and not part.flags.writeable
        assert np.array_equal(part, parts.order[parts.offsets[k]:parts.offsets[k + 1]])
        assert (np.diff(part) > 0).all()
    with pytest.raises(ValueError, match="read-only"):
        parts[3][0] = 0
    with pytest.raises(ValueError, match="read-only"):
        parts.order[0] = 0
    assert np.array_equal(parts[-1], parts[9]) and np.array_equal(parts[np.int64(4)], parts[4])
    with pytest.raises(IndexError):
        parts[10]


def test_a_slice_is_a_partition_of_those_parts_sharing_the_order():
    parts = partition(DIGITS, 12, "iid", seed=6)
    middle = parts[3:7]
    assert isinstance(middle, Partition) and len(middle) == 4 and middle.offsets[0] == 0
    assert all(np.array_equal(a, parts[3 + k]) for k, a in enumerate(middle))
    assert np.shares_memory(middle.order, parts.order) and not middle.order.flags.writeable
    assert middle.sizes.tolist() == parts.sizes[3:7].tolist()
    assert len(parts[5:5]) == 0 and len(parts[8:2]) == 0 and len(parts[-2:]) == 2
    assert [len(p) for p in parts[10:]] == [len(parts[10]), len(parts[11])]
    with pytest.raises(TypeError, match="not with a step"):
        parts[::2]


def test_a_partition_reads_as_the_list_it_replaces():
    parts = partition(DIGITS, 5, "shards:2", seed=1)
    assert len(np.concatenate(parts)) == len(DIGITS) and sum(map(len, parts)) == len(DIGITS)
    assert [len(p) for p in parts] == parts.sizes.tolist()
    assert DIGITS[parts[2]].shape == (len(parts[2]),)
    assert np.array_equal(partition_dataset(load_digits(), 5, "shards:2", 1).order, parts.order)


def test_offsets_that_do_not_cover_the_order_are_refused():
    with pytest.raises(ValueError, match="rise from 0 to the 3 indices"):
        Partition(np.arange(3), np.array([0, 2]))
    with pytest.raises(ValueError, match="rise from 0"):
        Partition(np.arange(3), np.array([0, 2, 1, 3]))


def test_kshard_leftovers_are_in_no_part():
    parts = partition(DIGITS, 7, "kshard:3", seed=0)  # int(N / 7) // 3 per run: some samples left over
    assert len(parts.order) == 7 * (len(DIGITS) // 7 // 3) * 3 < len(DIGITS)
    assert len(np.unique(parts.order)) == len(parts.order)


# --- scale -------------------------------------------------------------------------------------------

def _peak_bytes(build):
    """What ``build()`` returns and the most memory it held at once (numpy's arrays included)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = build()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def million_labels():
    return np.random.default_rng(0).integers(0, CLASSES, SAMPLES)


def test_iid_over_100000_clients_holds_a_few_arrays_of_the_samples(million_labels):
    parts, peak = _peak_bytes(lambda: partition(million_labels, CLIENTS, "iid", seed=1))
    assert len(parts) == CLIENTS and parts.sizes.min() == parts.sizes.max() == SAMPLES // CLIENTS
    assert peak < PEAK_MULTIPLE * million_labels.nbytes, f"peak {peak / 2**20:.1f} MiB"
    assert np.array_equal(np.sort(parts.order), np.arange(SAMPLES))


def test_dirichlet_over_100000_clients_holds_a_few_arrays_of_the_samples(million_labels):
    parts, peak = _peak_bytes(lambda: partition(million_labels, CLIENTS, "dirichlet:1000", seed=1))
    assert len(parts) == CLIENTS and parts.sizes.min() >= 1 and parts.sizes.sum() == SAMPLES
    assert peak < PEAK_MULTIPLE * million_labels.nbytes, f"peak {peak / 2**20:.1f} MiB"
    fewer, peak = _peak_bytes(lambda: partition(million_labels, CLIENTS // 10, "dirichlet:0.5", seed=1))
    assert fewer.sizes.min() >= 1 and peak < PEAK_MULTIPLE * million_labels.nbytes, f"peak {peak / 2**20:.1f} MiB"


def test_dirichlet_that_leaves_a_client_empty_says_so_in_one_line(million_labels, monkeypatch):
    """About 10 samples a client, drawn with alpha 0.5: each draw leaves hundreds of the 100,000
    clients without a sample, so after its draws (3 here, not 100: the same path) it stops, with
    one line, in the same memory."""
    monkeypatch.setattr(partition_module, "DIRICHLET_DRAWS", 3)
    error, peak = _peak_bytes(lambda: pytest.raises(DatasetError, partition, million_labels, CLIENTS,
                                                    "dirichlet:0.5", 1))
    assert str(error.value) == ("dirichlet:0.5 left a node without samples in 3 draws (1000000 samples, "
                                "100000 nodes); use a larger ALPHA or fewer nodes")
    assert peak < PEAK_MULTIPLE * million_labels.nbytes, f"peak {peak / 2**20:.1f} MiB"
