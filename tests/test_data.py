"""Datasets and partitioners, on embedded data and small files written here in each real format."""

import gzip
import io
import json
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from meshlearn.data import (
    ShardLoader,
    load_cifar10,
    load_dataset,
    load_digits,
    load_idx,
    load_imagefolder,
    load_leaf,
    partition,
    partition_dataset,
)
from meshlearn.errors import DatasetError

SHARED = Path(__file__).resolve().parents[2] / "shared" / "datasets"


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLEARN_CACHE", str(tmp_path / "cache"))


def test_digits_shapes_and_fixed_split():
    first, second = load_digits(), load_digits()
    assert first.input_shape == (1, 8, 8) and first.num_classes == 10
    assert len(first.train_y) + len(first.test_y) == 1797
    assert torch.equal(first.test_y, second.test_y) and torch.equal(first.train_x, second.train_x)
    raw = first.test_x[:5]
    kept = raw.clone()
    batch = first.normalize(raw)
    assert batch.dtype == torch.float32 and batch.shape == (5, 1, 8, 8)
    assert torch.equal(raw, kept)  # digits are stored as floats: normalized on a copy, never in the dataset
    mean, std = torch.tensor(first.mean).view(1, -1, 1, 1), torch.tensor(first.std).view(1, -1, 1, 1)
    assert torch.equal(batch, (raw.float() - mean) / std)


def _idx_bytes(array: np.ndarray) -> bytes:
    return struct.pack(">HBB", 0, 8, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def _write_idx(root: Path, n_train=20, n_test=10, gz=True):
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        files = {f"{prefix}-images-idx3-ubyte": rng.integers(0, 256, (n, 28, 28), dtype=np.uint8),
                 f"{prefix}-labels-idx1-ubyte": (np.arange(n) % 10).astype(np.uint8)}
        for name, array in files.items():
            data = _idx_bytes(array)
            if gz:
                (root / f"{name}.gz").write_bytes(gzip.compress(data))
            else:
                (root / name).write_bytes(data)


@pytest.mark.parametrize("gz", [True, False])
def test_idx_loader(tmp_path, gz):
    _write_idx(tmp_path / "fm", gz=gz)
    data = load_idx(tmp_path / "fm")
    assert data.input_shape == (1, 28, 28) and len(data.train_y) == 20 and len(data.test_y) == 10
    assert data.train_x.dtype == torch.uint8 and data.num_classes == 10


def test_idx_malformed(tmp_path):
    _write_idx(tmp_path / "fm")
    target = tmp_path / "fm" / "train-images-idx3-ubyte.gz"
    good = gzip.decompress(target.read_bytes())
    target.write_bytes(gzip.compress(b"\x00\x00\x09\x03" + good[4:]))
    with pytest.raises(DatasetError, match="bad header"):
        load_idx(tmp_path / "fm")
    target.write_bytes(gzip.compress(good[:-5]))
    with pytest.raises(DatasetError, match="header says"):
        load_idx(tmp_path / "fm")
    with pytest.raises(DatasetError, match="does not exist"):
        load_idx(tmp_path / "nowhere")


@pytest.mark.skipif(not (SHARED / "fashion-mnist").is_dir(), reason="../shared/datasets not present")
def test_real_fashion_mnist():
    data = load_dataset(f"fashion-mnist:{SHARED / 'fashion-mnist'}")
    assert len(data.train_y) == 60_000 and len(data.test_y) == 10_000 and data.input_shape == (1, 28, 28)
    assert set(data.train_y.unique().tolist()) == set(range(10))


def _write_cifar_batches(root: Path, per_batch=10):
    root.mkdir(parents=True)
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": [int(v) for v in rng.integers(0, 10, per_batch)]}
        (root / name).write_bytes(pickle.dumps(batch))
    names = [b"airplane", b"automobile", b"bird", b"cat", b"deer", b"dog", b"frog", b"horse", b"ship", b"truck"]
    (root / "batches.meta").write_bytes(pickle.dumps({b"label_names": names}))


def test_cifar_python_batches(tmp_path):
    _write_cifar_batches(tmp_path / "cifar-10-batches-py")
    for path in (tmp_path / "cifar-10-batches-py", tmp_path):
        data = load_cifar10(path)
        assert data.input_shape == (3, 32, 32) and len(data.train_y) == 50 and len(data.test_y) == 10
        assert data.class_names[0] == "airplane"


def test_decoded_datasets_are_one_memory_mapped_copy_with_their_statistics(tmp_path, monkeypatch):
    # Every node process maps the same decoded uint8 file instead of holding its own copy, and reads
    # the channel statistics the first load wrote instead of converting 10,000 samples again.
    from meshlearn.data import datasets

    _write_cifar_batches(tmp_path / "batches")
    _write_idx(tmp_path / "fm")
    first = [load_cifar10(tmp_path / "batches"), load_idx(tmp_path / "fm")]
    monkeypatch.setattr(datasets, "_channel_stats", lambda x: pytest.fail("statistics computed again"))
    monkeypatch.setattr(datasets, "_unpickle_local", lambda path: pytest.fail("batches decoded again"))
    again = [load_cifar10(tmp_path / "batches"), load_idx(tmp_path / "fm")]
    for one, two in zip(first, again):
        assert torch.equal(one.train_x, two.train_x) and (one.mean, one.std) == (two.mean, two.std)
        assert one.class_names == two.class_names and two.train_x.dtype == torch.uint8
        assert _mapped_file(two.train_x).startswith(str(tmp_path / "cache")), "not read from the cache file"
    assert again[0].class_names[0] == "airplane"
    caches = sorted(p.name.split("-")[0] for p in (tmp_path / "cache").iterdir())
    assert caches == ["cifar10", "idx"]


def _mapped_file(tensor: torch.Tensor) -> str:
    """The file whose mapping holds ``tensor``'s data in this process ('' if none does)."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, stop = (int(v, 16) for v in fields[0].split("-"))
        if start <= address < stop:
            return fields[5] if len(fields) == 6 else ""
    return ""


def test_channel_statistics_in_float32_chunks_equal_float64_ones():
    from meshlearn.data.datasets import _channel_stats

    x = np.random.default_rng(4).integers(0, 256, (1234, 3, 8, 8), dtype=np.uint8)
    reference = x.astype(np.float64) / 255.0
    mean, std = _channel_stats(x)
    assert np.allclose(mean, reference.mean(axis=(0, 2, 3)), atol=1e-7)
    assert np.allclose(std, reference.std(axis=(0, 2, 3)), atol=1e-7)


def _write_tree(root: Path, classes=("cat", "dog"), per_class=3, size=(6, 5)):
    from PIL import Image

    rng = np.random.default_rng(2)
    for split in ("train", "test"):
        for name in classes:
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(per_class):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.png")


def test_imagefolder_and_its_cache(tmp_path):
    _write_tree(tmp_path / "tree")
    first = load_imagefolder(tmp_path / "tree")
    assert first.input_shape == (3, 5, 6) and first.class_names == ("cat", "dog")
    assert len(first.train_y) == 6 and first.train_y.tolist() == [0, 0, 0, 1, 1, 1]
    again = load_imagefolder(tmp_path / "tree")  # from the decoded cache
    assert torch.equal(first.train_x, again.train_x)
    assert load_cifar10(tmp_path).num_classes == 2  # a parent holding one tree


def test_a_limited_evaluation_samples_every_class_of_a_test_set_stored_class_by_class(tmp_path):
    from meshlearn.data import test_samples
    from meshlearn.evaluation import evaluate_model

    _write_tree(tmp_path / "tree", classes=("a", "b", "c", "d"), per_class=5)
    data = load_imagefolder(tmp_path / "tree")
    assert data.test_y.tolist() == [0] * 5 + [1] * 5 + [2] * 5 + [3] * 5  # stored class by class
    x, y = test_samples(data, 8)
    assert y.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]  # positions 0, 2, 5, 7, 10, 12, 15, 17
    assert torch.equal(x[2], data.test_x[5]) and torch.equal(x[7], data.test_x[17])
    assert test_samples(data, 0)[1] is data.test_y and test_samples(data, 99)[1] is data.test_y

    class AlwaysA(torch.nn.Module):
        def forward(self, x):
            return torch.tensor([10.0, 0, 0, 0]).expand(len(x), 4)

    # the first 8 samples would be 5 a's and 3 b's: 62.5% for a model that always answers a
    assert evaluate_model(AlwaysA(), data, limit=8).accuracy == pytest.approx(0.25)


def test_tar_gz_and_path_traversal(tmp_path):
    _write_tree(tmp_path / "src" / "set")
    archive = tmp_path / "set.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tmp_path / "src" / "set", arcname="set")
    assert load_cifar10(archive).num_classes == 2
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(DatasetError, match="unsafe member"):
        load_cifar10(evil)
    assert not (tmp_path / "cache" / "escape.txt").exists()


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "cifar10-jpeg.tar.gz").is_file(), reason="../shared/datasets not present")
def test_real_cifar10_jpeg():
    data = load_dataset(f"cifar10:{SHARED / 'cifar10-jpeg.tar.gz'}")
    assert len(data.train_y) == 50_000 and len(data.test_y) == 10_000 and data.input_shape == (3, 32, 32)


def test_unknown_dataset_spec():
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("imagenet")
    with pytest.raises(DatasetError, match="does not exist"):
        load_dataset("mnist:/nonexistent/path")


LABELS = load_digits().train_y.numpy()


@pytest.mark.parametrize("spec", ["iid", "shards:2", "shards:4", "dirichlet:0.5", "dirichlet:10"])
def test_partitions_disjoint_covering_and_seeded(spec):
    parts = partition(LABELS, 10, spec, seed=4)
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS) and len(np.unique(joined)) == len(LABELS)
    assert all(len(p) > 0 for p in parts)
    again = partition(LABELS, 10, spec, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition(LABELS, 10, spec, seed=5)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_shards_are_non_iid():
    classes_per_node = lambda spec: [len(np.unique(LABELS[p])) for p in partition(LABELS, 10, spec, seed=1)]
    assert max(classes_per_node("shards:2")) <= 4
    assert min(classes_per_node("iid")) >= 9
    assert np.mean(classes_per_node("dirichlet:0.1")) < np.mean(classes_per_node("dirichlet:100"))


def test_kshard_is_decentralizepys_k_shard_draw_for_draw():
    labels = np.array([1, 0, 1, 0, 1, 0, 1, 0, 1, 0])  # by label: 1 3 5 7 9 (label 0), then 0 2 4 6 8
    # seed 0: random.Random(0).randint(0, 9) = 6, so node 0 takes 5 samples from place 6, wrapping
    # around: 2 4 6 8 and then 1; node 1 draws randint(0, 4) = 3 among 3 5 7 9 0: 9 0, then 3 5 7
    node0, node1 = partition(labels, 2, "kshard:1", seed=0)
    assert node0.tolist() == [1, 2, 4, 6, 8] and node1.tolist() == [0, 3, 5, 7, 9]
    parts = partition(LABELS, 10, "kshard:2", seed=1)
    assert all(len(p) == len(LABELS) // 10 // 2 * 2 for p in parts)  # int(N / n) // K per run
    assert len(np.unique(np.concatenate(parts))) == sum(map(len, parts))  # disjoint
    # runs of the label-sorted order, but of what earlier nodes left: 3-7 classes (iid: all 10)
    assert max(len(np.unique(LABELS[p])) for p in parts) <= 7


@pytest.mark.parametrize("spec", ["random", "shards:0", "shards:x", "dirichlet:-1", "shards:1000", "kshard:0",
                                  "kshard:1000"])
def test_bad_partitions(spec):
    with pytest.raises(DatasetError):
        partition(LABELS, 10, spec, seed=0)


def test_shard_loader():
    data = load_digits()
    indices = np.arange(50)
    loader = ShardLoader(data, indices, batch_size=16, seed=3)
    sizes = [len(loader.next_batch()[1]) for _ in range(4)]
    assert sizes == [16, 16, 16, 2] and loader.epoch == 0
    x, y = loader.next_batch()
    assert loader.epoch == 1 and x.shape == (16, 1, 8, 8) and x.dtype == torch.float32
    same = ShardLoader(data, indices, batch_size=16, seed=3)
    assert torch.equal(same.next_batch()[1], ShardLoader(data, indices, batch_size=16, seed=3).next_batch()[1])
    assert ShardLoader(data, indices[:5], batch_size=16, seed=0).next_batch()[0].shape[0] == 5


def _reference_batches(shard: np.ndarray, batch_size: int, seed: int, count: int) -> list[list[int]]:
    """A node's first ``count`` batches, by the rule written out: a seeded generator of its own
    reshuffles the shard each epoch, and a batch ends where the epoch does."""
    generator, batches, order, pos = torch.Generator().manual_seed(seed), [], [], 0
    while len(batches) < count:
        if pos >= len(order):
            order = shard[torch.randperm(len(shard), generator=generator).numpy()] if len(shard) > 1 else shard
            pos = 0
        batches.append(order[pos:pos + batch_size].tolist())
        pos += len(batches[-1])
    return batches


def test_shard_loaders_draw_every_nodes_batches_as_its_own_loader_would():
    from meshlearn.data import ShardLoaders

    shards = [np.array([7]), np.array([3, 9]), np.arange(20, 25), np.arange(40, 52)]
    seeds = [11, 12, 13, 14]
    loaders = ShardLoaders(shards, 4, seeds)
    expected = [_reference_batches(shard, 4, seed, 6) for shard, seed in zip(shards, seeds)]
    drawn: list[list[list[int]]] = [[] for _ in shards]
    for step in range(6):
        groups = loaders.next()
        assert sorted(node for members, _ in groups for node in members.tolist()) == [0, 1, 2, 3]
        assert len({picks.shape[1] for _, picks in groups}) == len(groups)  # a group per batch size
        for members, picks in groups:
            for node, pick in zip(members.tolist(), picks.tolist()):
                drawn[node].append(pick)
    assert drawn == expected
    assert loaders.epochs.tolist() == [5, 5, 2, 1] and loaders.samples_seen.tolist() == [6, 12, 15, 24]
    only = ShardLoaders(shards, 4, seeds)
    for step in range(3):  # a subset of the nodes draws; the others keep their place
        (members, picks), = only.next([2])
        assert members.tolist() == [2] and picks[0].tolist() == expected[2][step]
    assert only.next([3])[0][1][0].tolist() == expected[3][0]
    with pytest.raises(ValueError, match="empty"):
        ShardLoaders([np.array([1]), np.array([], dtype=np.int64)], 4, [1, 2])


def test_a_registered_dataset_is_named_like_a_built_in_one_and_checked(tmp_path):
    import numpy as np

    from meshlearn.data import Dataset, load_dataset, make_dataset, parse_spec, register_dataset
    from meshlearn.errors import DatasetError
    from meshlearn.plugins import load_user_module

    load_user_module(Path(__file__).resolve().parents[1] / "examples" / "my_models.py")
    data = load_dataset("templates:20")
    assert isinstance(data, Dataset) and data.input_shape == (1, 8, 8) and len(data.train_y) == 200
    assert parse_spec("templates") == ("templates", None)
    with pytest.raises(DatasetError, match="built in"):
        register_dataset("digits")
    register_dataset("not-a-dataset")(lambda path: "oops")
    with pytest.raises(DatasetError, match="not a Dataset"):
        load_dataset("not-a-dataset")
    x = np.zeros((4, 1, 2, 2), dtype=np.float32)
    with pytest.raises(DatasetError, match="labels must lie in 0..1"):
        make_dataset("bad", x, [0, 1, 2, 0], x, [0, 0, 0, 0], ["a", "b"])
    with pytest.raises(DatasetError, match=r"\(N, C, H, W\)"):
        make_dataset("bad", x[:, 0], [0] * 4, x[:, 0], [0] * 4, ["a"])


def _leaf_folder(root: Path, side: int = 28) -> Path:
    """A small LEAF (FEMNIST-style) folder: 6 writers in 2 files per split, pixels in 0..1."""
    rng = np.random.default_rng(0)
    for split, per_writer in (("train", 4), ("test", 2)):
        (root / split).mkdir(parents=True)
        for f in range(2):
            users = [f"w{f}{u}" for u in range(3)]
            data = {"users": users, "num_samples": [per_writer] * 3, "user_data": {
                u: {"x": rng.random((per_writer, side * side)).round(3).tolist(),
                    "y": [(3 * f + i) % 62 for i in range(per_writer)]} for i, u in enumerate(users)}}
            (root / split / f"part{f}.json").write_text(json.dumps(data))
    return root


def test_leaf_writers_become_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHLEARN_CACHE", str(tmp_path / "cache"))
    data = load_leaf(_leaf_folder(tmp_path / "leaf"))
    assert data.train_x.shape == (24, 1, 28, 28) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (12, 1, 28, 28) and data.num_classes == int(data.train_y.max()) + 1
    assert data.train_groups.tolist() == [w for w in range(6) for _ in range(4)]  # file order, writer order
    parts = partition_dataset(data, 3, "writers", seed=0)
    assert [p.tolist() for p in parts] == [list(range(0, 8)), list(range(8, 16)), list(range(16, 24))]
    again = load_dataset(f"femnist:{tmp_path / 'leaf'}")  # the cache, with its writers
    assert torch.equal(again.train_groups, data.train_groups) and torch.equal(again.train_x, data.train_x)
    with pytest.raises(DatasetError, match="6 writers cannot be shared by 7 nodes"):
        partition_dataset(data, 7, "writers", seed=0)
    with pytest.raises(DatasetError, match="needs a dataset of writers"):
        partition(LABELS, 3, "writers", seed=0)


@pytest.mark.parametrize("breakage,message", [
    (lambda root: (root / "test" / "part0.json").unlink() or (root / "test" / "part1.json").unlink(),
     "holds no .json files"),
    (lambda root: (root / "train" / "part0.json").write_text('{"users": ["a"]}'), "not a LEAF file"),
    (lambda root: (root / "train" / "part0.json").write_text(
        json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 10], "y": [1]}}})), "square images"),
    (lambda root: (root / "train" / "part0.json").write_text(
        json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [1, 2]}}})), "as many samples"),
    (lambda root: (root / "train" / "part0.json").write_text('{"users": 5, "user_data": {}}'), "list of names"),
    (lambda root: (root / "train" / "part0.json").write_text('{"users": [["a"]], "user_data": {}}'), "list of names"),
    (lambda root: (root / "train" / "part0.json").write_text(
        json.dumps({"users": ["a"], "user_data": {"a": {"x": [[0.5] * 784], "y": [10 ** 12]}}})), "labels must lie"),
])
def test_a_bad_leaf_folder_is_one_clear_error(tmp_path, monkeypatch, breakage, message):
    monkeypatch.setenv("MESHLEARN_CACHE", str(tmp_path / "cache"))
    root = _leaf_folder(tmp_path / "leaf")
    breakage(root)
    with pytest.raises(DatasetError, match=message):
        load_leaf(root)


def test_digits_are_scikit_learns_read_without_importing_it():
    import subprocess
    import sys

    from sklearn.datasets import load_digits as scikit_digits

    from meshlearn.data.datasets import load_digits

    ours, theirs = load_digits(), scikit_digits()
    images = np.concatenate([ours.train_x.numpy(), ours.test_x.numpy()])
    labels = np.concatenate([ours.train_y.numpy(), ours.test_y.numpy()])
    expected = (theirs.images.astype(np.float32) / 16.0)[:, None]
    order = np.lexsort([labels] + [images.reshape(len(images), -1)[:, k] for k in range(64)])
    reference = np.lexsort([theirs.target] + [expected.reshape(len(expected), -1)[:, k] for k in range(64)])
    assert np.array_equal(images[order], expected[reference])
    assert np.array_equal(labels[order], theirs.target[reference])
    program = ("import sys; from meshlearn.data.datasets import load_digits; load_digits(); "
               "print('sklearn' in sys.modules)")
    loaded = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert loaded.stdout.strip() == "False", loaded.stderr
