"""Datasets held in memory as tensors: digits (embedded), MNIST/Fashion-MNIST, CIFAR-10, ImageFolder
(LEAF's per-writer JSON: ``data.leaf``; text: ``data.text``)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import struct
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from meshlearn.data.specs import require_path
from meshlearn.errors import DatasetError

if TYPE_CHECKING:
    from meshlearn.data.synthetic import SyntheticPopulation

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm"}


@dataclass(frozen=True)
class Dataset:
    """Train and test samples as tensors, their targets, and what the model reads of them.

    Images (``task`` classification): samples (N, C, H, W), a class label each, per-channel
    normalization. Text (``task`` language-model, ``data.text``): windows of token ids (N, T), the
    next token at each position as targets, no channel statistics; ``num_classes`` is then the
    vocabulary's size and ``class_names`` the tokens."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    num_classes: int
    class_names: tuple[str, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    train_groups: torch.Tensor | None = None  # per training sample, its writer (LEAF): partition "writers"
    task: str = "classification"  # what a model learns from it (meshlearn.tasks)
    population: SyntheticPopulation | None = None  # a generated data set's users, on demand (data.synthetic)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """The shape of one sample: (C, H, W) of an image, (T,) of a text window."""
        return tuple(self.train_x.shape[1:])

    @property
    def tokens(self) -> bool:
        """Whether samples are token ids (text), which models read as they are, not normalized."""
        return not self.mean

    @property
    def population_only(self) -> bool:
        """Whether the training arrays hold only some of a generated population's users (too many to
        hold at once): the population gives every user's samples on demand (``data.synthetic``)."""
        return self.population is not None and len(self.train_y) < self.population.train_samples

    def normalize(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Raw samples to what the model reads (a new tensor, or ``out``, shaped like ``x``, where
        given; ``x`` is left as it is): token ids as int64; images (uint8 0..255 or float 0..1) as
        normalized float32, in place on that one copy (the same arithmetic as out of place, bit for
        bit, without a fresh tensor per operation: 17 to 0.8 ms for a batch of 3,200 Fashion-MNIST
        images)."""
        if self.tokens:
            return x.to(torch.int64) if out is None else out.copy_(x)
        x = x.to(torch.float32, copy=True) if out is None else out.copy_(x)
        if self.train_x.dtype == torch.uint8:
            x.div_(255.0)
        mean = torch.tensor(self.mean, dtype=torch.float32).view(1, -1, 1, 1)
        std = torch.tensor(self.std, dtype=torch.float32).view(1, -1, 1, 1)
        return x.sub_(mean).div_(std)


STATS_SAMPLES = 10_000  # channel statistics come from the first samples
STATS_CHUNK = 500  # samples converted to float at a time (bounds the memory the statistics take)


def _channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std in the 0..1 scale, from at most 10,000 samples.

    Converted a chunk at a time into float32, summed into float64 per channel: a node process
    never holds a float copy of the samples (a float64 one of 10,000 CIFAR-10 images was 245 MB,
    twice over while the std was taken)."""
    count = min(len(x), STATS_SAMPLES)
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    sums = np.zeros(x.shape[1], dtype=np.float64)
    squares = np.zeros(x.shape[1], dtype=np.float64)
    for start in range(0, count, STATS_CHUNK):
        chunk = np.asarray(x[start:min(start + STATS_CHUNK, count)], dtype=np.float32) / np.float32(scale)
        sums += chunk.sum(axis=(0, 2, 3), dtype=np.float64)
        squares += np.square(chunk).sum(axis=(0, 2, 3), dtype=np.float64)
    values = max(1, count * x.shape[2] * x.shape[3])
    mean = sums / values
    std = np.sqrt(np.maximum(squares / values - mean ** 2, 0.0))
    return tuple(float(m) for m in mean), tuple(float(max(s, 1e-6)) for s in std)


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor viewing the array without a copy (memory maps and IDX buffers are read-only,
    and samples are only ever read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(array))


def make_dataset(name: str, train_x: np.ndarray, train_y, test_x: np.ndarray, test_y,
                 class_names: list[str] | tuple[str, ...]) -> Dataset:
    """A Dataset from arrays: samples (N, C, H, W) as uint8 0..255 or float 0..1, integer labels
    0..len(class_names)-1. What a registered dataset's factory returns."""
    train_x, test_x = np.asarray(train_x), np.asarray(test_x)
    if train_x.ndim != 4 or test_x.shape[1:] != train_x.shape[1:]:
        raise DatasetError(f"dataset {name}: samples must be (N, C, H, W) arrays of one shape, got "
                           f"{train_x.shape} and {test_x.shape}")
    labels = np.concatenate([np.asarray(train_y).ravel(), np.asarray(test_y).ravel()])
    if len(train_y) != len(train_x) or len(test_y) != len(test_x):
        raise DatasetError(f"dataset {name}: one label per sample is needed")
    if labels.size and (labels.min() < 0 or labels.max() >= len(class_names)):
        raise DatasetError(f"dataset {name}: labels must lie in 0..{len(class_names) - 1} (one per class name)")
    return _make(name, train_x, train_y, test_x, test_y, class_names)


def _make(name, train_x, train_y, test_x, test_y, class_names, stats=None) -> Dataset:
    mean, std = stats or _channel_stats(train_x)
    return Dataset(
        name=name,
        train_x=_tensor(train_x),
        train_y=torch.from_numpy(np.array(train_y, dtype=np.int64)),
        test_x=_tensor(test_x),
        test_y=torch.from_numpy(np.array(test_y, dtype=np.int64)),
        num_classes=len(class_names),
        class_names=tuple(class_names),
        mean=mean,
        std=std,
    )


VALIDATION_SALT = 0x7A1


def split_validation(dataset: Dataset, fraction: float, seed: int) -> tuple[Dataset, Dataset | None]:
    """The dataset with a seeded ``fraction`` of its test set held out, and a dataset whose test
    set is that held-out part (None when ``fraction`` is 0): the same split on every node
    (DecentralizePy's ``validation_source = Test``)."""
    if not fraction:
        return dataset, None
    order = np.random.default_rng([seed, VALIDATION_SALT]).permutation(len(dataset.test_y))
    count = int(round(fraction * len(order)))
    if not 0 < count < len(order):
        raise DatasetError(f"validation {fraction:g} of {len(order)} test samples leaves none on one side; "
                           "choose another share")
    held, rest = (torch.from_numpy(np.sort(part)) for part in (order[:count], order[count:]))
    test = Dataset(**{**dataset.__dict__, "test_x": dataset.test_x[rest], "test_y": dataset.test_y[rest]})
    return test, Dataset(**{**dataset.__dict__, "test_x": dataset.test_x[held], "test_y": dataset.test_y[held]})


RESHUFFLE_SALT = 0x5E5


def reshuffled(dataset: Dataset, seed: int) -> Dataset:
    """The dataset with its train and test sets pooled and split again, seeded by ``seed``: the same
    sizes, each class giving the test set its share of the pool (stratified, largest remainders
    first), samples kept in pool order on each side. The same seed gives the same split; the
    channel statistics stay those of the stored training set. A dataset whose training samples have
    writers (LEAF) is refused: its test samples have none."""
    if dataset.tokens:
        raise DatasetError(f"dataset {dataset.name}: reshuffle pools labelled samples; a text corpus is split by "
                           "file already: leave reshuffle off")
    if dataset.train_groups is not None:
        raise DatasetError(f"dataset {dataset.name}: reshuffle would mix test samples, which have no writer, into "
                           "the training set of a dataset split by writer (LEAF): leave reshuffle off")
    stored = len(dataset.train_y)
    labels = torch.cat([dataset.train_y, dataset.test_y]).numpy()
    tests = len(dataset.test_y)
    order = np.random.default_rng([seed, RESHUFFLE_SALT]).permutation(len(labels))
    counts = np.bincount(labels, minlength=dataset.num_classes)
    share = counts * tests / max(1, len(labels))
    quota = np.floor(share).astype(np.int64)
    quota[np.argsort(-(share - quota), kind="stable")[:tests - int(quota.sum())]] += 1
    shuffled = labels[order]
    test = np.sort(np.concatenate([order[shuffled == c][:quota[c]] for c in range(len(counts))]))
    train = np.setdiff1d(np.arange(len(labels)), test)  # sorted

    def take(x: torch.Tensor, y: torch.Tensor, side: np.ndarray, other_x: torch.Tensor, other_y: torch.Tensor):
        own, rest = torch.from_numpy(side[side < stored]), torch.from_numpy(side[side >= stored] - stored)
        return torch.cat([x[own], other_x[rest]]), torch.cat([y[own], other_y[rest]])

    train_x, train_y = take(dataset.train_x, dataset.train_y, train, dataset.test_x, dataset.test_y)
    test_x, test_y = take(dataset.train_x, dataset.train_y, test, dataset.test_x, dataset.test_y)
    return Dataset(**{**dataset.__dict__, "train_x": train_x, "train_y": train_y, "test_x": test_x, "test_y": test_y})


def test_samples(dataset: Dataset, limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The test samples (images, labels) an evaluation limited to ``limit`` samples uses (0 = all):
    evenly spaced over the whole test set, so a test set stored class by class (ImageFolder trees,
    CIFAR-10's JPEGs) gives every class its share, not the first classes only; the same samples
    on every node, engine and provider."""
    count = len(dataset.test_y)
    if not limit or limit >= count:
        return dataset.test_x, dataset.test_y
    chosen = torch.arange(limit, dtype=torch.int64) * count // limit
    return dataset.test_x[chosen], dataset.test_y[chosen]


def shard_as_test_set(dataset: Dataset, indices) -> Dataset:
    """The dataset whose test set is the training samples ``indices`` (a node's shard), to measure
    a model's loss over its own training data (``train_evaluate``)."""
    chosen = torch.from_numpy(np.array(indices, dtype=np.int64))  # a copy: a Partition's parts are read-only
    return Dataset(**{**dataset.__dict__, "test_x": dataset.train_x[chosen], "test_y": dataset.train_y[chosen]})


# --- the decode cache: one uint8 copy per machine -------------------------------------------

ARRAYS = ("train_x", "train_y", "test_x", "test_y")
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, list[str]]  # + class names


def _cached(kind: str, key: str, build: Callable[[], Arrays], classes: list[str] | None = None,
            extras: tuple[str, ...] = ()) -> Dataset:
    """The dataset ``build`` decodes, kept on disk as .npy files (with its class names and channel
    statistics) under the cache and memory-mapped: decoded once per machine, and every process
    of it reads the same pages instead of holding its own copy. ``key`` names the source's version;
    ``classes``, where the caller knows them, name the classes of a cache that did not record them;
    ``extras`` name more arrays ``build`` returns after the four, Dataset fields (``train_groups``)."""
    names = ARRAYS + extras
    cache = _cache_root() / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    meta_path = cache / "meta.json"
    if not all((cache / f"{n}.npy").is_file() for n in names):
        *arrays, built_classes = build()
        cache.mkdir(parents=True, exist_ok=True)
        for name, array in zip(names, arrays):
            tmp = cache / f"{name}.{os.getpid()}.tmp.npy"
            np.save(tmp, array)
            tmp.replace(cache / f"{name}.npy")
        _write_json(meta_path, {"classes": list(built_classes)})
    arrays = [np.load(cache / f"{n}.npy", mmap_mode="r") for n in names]
    more = {name: torch.from_numpy(np.array(array)) for name, array in zip(extras, arrays[len(ARRAYS):])}  # small
    arrays = arrays[:len(ARRAYS)]
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    classes = meta.get("classes") or classes or _class_names_of(arrays)
    if isinstance(meta.get("mean"), list) and isinstance(meta.get("std"), list):
        stats = (tuple(meta["mean"]), tuple(meta["std"]))
    else:  # computed once, then read by every process (computing them touches 10,000 samples)
        stats = _channel_stats(arrays[0])
        _write_json(meta_path, {"classes": list(classes), "mean": list(stats[0]), "std": list(stats[1])})
    dataset = _make(kind, *arrays, classes, stats)
    return Dataset(**{**dataset.__dict__, **more}) if more else dataset


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.json")
    tmp.write_text(json.dumps(value))
    tmp.replace(path)


def _class_names_of(arrays: list[np.ndarray]) -> list[str]:
    """Class names 0..K-1 from the labels (an old cache that did not record them)."""
    return [str(c) for c in range(int(max(arrays[1].max(), arrays[3].max())) + 1)]


def _file_key(*paths: Path) -> str:
    """A version key of source files: where they are, their sizes and modification times."""
    parts = []
    for path in paths:
        stat = path.stat()
        parts.append(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}")
    return "\n".join(parts)


def load_digits() -> Dataset:
    """scikit-learn's embedded 8x8 digits (1,797 images), split 80/20 stratified, always the same way.
    Read from the file scikit-learn ships, as its ``load_digits`` reads it, without importing
    scikit-learn (a second and a half, in every process that loads the digits)."""
    import importlib.util

    found = importlib.util.find_spec("sklearn")
    path = None if found is None or not found.submodule_search_locations else \
        Path(list(found.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    if path is None or not path.is_file():
        raise DatasetError("the digits dataset is the one scikit-learn ships: pip install scikit-learn")
    data = np.loadtxt(path, delimiter=",")
    x = (data[:, :-1].reshape(-1, 8, 8).astype(np.float32) / 16.0)[:, None, :, :]
    y = data[:, -1].astype(np.int64)
    rng = np.random.default_rng(0)
    test = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        members = np.flatnonzero(y == label)
        test[rng.choice(members, size=round(len(members) * 0.2), replace=False)] = True
    return _make("digits", x[~test], y[~test], x[test], y[test], [str(i) for i in range(10)])


# --- MNIST / Fashion-MNIST -------------------------------------------------------------------

def _read_idx(path: Path, expected_dims: int) -> np.ndarray:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            data = handle.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(f"cannot read IDX file {path}: {exc}") from None
    if len(data) < 4:
        raise DatasetError(f"IDX file {path} is truncated")
    zero, dtype_code, dims = struct.unpack_from(">HBB", data, 0)
    if zero != 0 or dtype_code != 0x08 or dims != expected_dims:
        raise DatasetError(f"IDX file {path} has a bad header (magic {data[:4].hex()}); expected unsigned bytes "
                           f"in {expected_dims} dimensions")
    if len(data) < 4 + 4 * dims:
        raise DatasetError(f"IDX file {path} is truncated")
    shape = struct.unpack_from(f">{dims}I", data, 4)
    offset = 4 + 4 * dims
    if len(data) - offset != int(np.prod(shape)):
        raise DatasetError(f"IDX file {path} holds {len(data) - offset} bytes of data, its header says "
                           f"{int(np.prod(shape))}")
    return np.frombuffer(data, dtype=np.uint8, offset=offset).reshape(shape)


def _find_idx(root: Path, stem: str) -> Path:
    for candidate in (root / f"{stem}.gz", root / stem):
        if candidate.is_file():
            return candidate
    raise DatasetError(f"{root} has no {stem}.gz (or {stem}): give the folder holding the four IDX files")


def load_idx(path: str | Path, name: str = "fashion-mnist") -> Dataset:
    """MNIST or Fashion-MNIST from a folder of the standard (gzipped) IDX files (decoded once into
    the cache)."""
    root = Path(path)
    require_path(root, name)
    files = {(split, part): _find_idx(root, f"{prefix}-{part}")
             for split, prefix in (("train", "train"), ("test", "t10k")) for part in ("images-idx3-ubyte",
                                                                                     "labels-idx1-ubyte")}

    def build() -> Arrays:
        parts = {}
        for split in ("train", "test"):
            images = _read_idx(files[split, "images-idx3-ubyte"], 3)
            labels = _read_idx(files[split, "labels-idx1-ubyte"], 1)
            if len(images) != len(labels):
                raise DatasetError(f"{root}: {split} has {len(images)} images but {len(labels)} labels")
            parts[split] = (images[:, None, :, :], labels)
        classes = [str(int(c)) for c in range(int(max(parts["train"][1].max(), parts["test"][1].max())) + 1)]
        return (*parts["train"], *parts["test"], classes)

    dataset = _cached("idx", _file_key(*files.values()), build)
    return Dataset(**{**dataset.__dict__, "name": name})


# --- CIFAR-10 ---------------------------------------------------------------------------------

def _unpickle_local(path: Path) -> dict:
    """Read one official CIFAR-10 python batch. These files are pickles; this reads only local files
    the user named on the command line, never anything received over a network."""
    try:
        with path.open("rb") as handle:
            return pickle.load(handle, encoding="bytes")  # local user file only, see docstring
    except Exception as exc:
        raise DatasetError(f"cannot read CIFAR-10 batch {path}: {exc}") from None


def _cifar_batches(root: Path) -> Dataset:
    files = [root / f"data_batch_{i}" for i in range(1, 6)] + [root / "test_batch"]
    for path in files:
        if not path.is_file():
            raise DatasetError(f"{root} has no {path.name}: give the folder of the CIFAR-10 python batches")

    def batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
        raw = _unpickle_local(path)
        try:
            data = np.asarray(raw[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            labels = np.asarray(raw[b"labels"], dtype=np.int64)
        except (KeyError, ValueError, TypeError):
            raise DatasetError(f"{path} is not a CIFAR-10 python batch (needs b'data' N x 3072 and b'labels')") \
                from None
        if len(data) != len(labels):
            raise DatasetError(f"{path}: {len(data)} images but {len(labels)} labels")
        return data, labels

    def build() -> Arrays:
        train = [batch(path) for path in files[:5]]
        test_x, test_y = batch(files[5])
        names = [str(i) for i in range(10)]
        meta = root / "batches.meta"
        if meta.is_file():
            names = [n.decode() if isinstance(n, bytes) else str(n)
                     for n in _unpickle_local(meta).get(b"label_names", names)]
        return (np.concatenate([x for x, _ in train]), np.concatenate([y for _, y in train]), test_x, test_y, names)

    return _cached("cifar10", _file_key(*files), build)


def _cache_root() -> Path:
    return Path(os.environ.get("MESHLEARN_CACHE", Path.home() / ".cache" / "meshlearn"))


def _extract_once(archive: Path) -> Path:
    """Extract a .tar.gz into the cache (once per archive version), refusing unsafe members."""
    stat = archive.stat()
    key = hashlib.sha256(f"{archive.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = _cache_root() / f"extract-{key}"
    if (target / ".complete").is_file():
        return target
    target.mkdir(parents=True, exist_ok=True)
    try:
        with tarfile.open(archive, "r:*") as tar:
            members = tar.getmembers()
            for member in members:
                parts = Path(member.name).parts
                if member.name.startswith("/") or ".." in parts or not (member.isfile() or member.isdir()):
                    raise DatasetError(f"archive {archive} has an unsafe member {member.name!r}: refusing to extract it")
            tar.extractall(target, members=members, filter="data")
    except (tarfile.TarError, OSError) as exc:
        raise DatasetError(f"cannot extract {archive}: {exc}") from None
    (target / ".complete").touch()
    return target


def _find_tree(root: Path) -> Path:
    """``root`` if it holds train/ and test/, or its single subfolder that does."""
    if (root / "train").is_dir() and (root / "test").is_dir():
        return root
    inner = [p for p in root.iterdir() if p.is_dir() and (p / "train").is_dir() and (p / "test").is_dir()]
    if len(inner) == 1:
        return inner[0]
    raise DatasetError(f"{root} holds neither train/ and test/ folders nor one folder that does")


def load_cifar10(path: str | Path) -> Dataset:
    """CIFAR-10 from the official python batches, an ImageFolder tree, or a .tar.gz of either."""
    root = Path(path)
    require_path(root, "cifar10")
    if root.is_file() and root.name.endswith((".tar.gz", ".tgz", ".tar")):
        root = _extract_once(root)
    if (root / "data_batch_1").is_file():
        return _cifar_batches(root)
    nested = root / "cifar-10-batches-py"
    if (nested / "data_batch_1").is_file():
        return _cifar_batches(nested)
    dataset = load_imagefolder(root)
    return Dataset(**{**dataset.__dict__, "name": "cifar10"})


# --- ImageFolder ------------------------------------------------------------------------------

def _image_files(split_dir: Path, classes: list[str]) -> list[tuple[Path, int]]:
    files = []
    for label, name in enumerate(classes):
        folder = split_dir / name
        if folder.is_dir():
            files += [(p, label) for p in sorted(folder.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES]
    return files


def _decode(files: list[tuple[Path, int]], size: tuple[int, int] | None, mode: str | None):
    from PIL import Image

    arrays, labels = [], []
    for path, label in files:
        try:
            with Image.open(path) as image:
                mode = mode or ("L" if image.mode in ("L", "1", "I;16") else "RGB")
                image = image.convert(mode)
                size = size or image.size
                if image.size != size:
                    image = image.resize(size)
                arrays.append(np.asarray(image, dtype=np.uint8))
        except OSError as exc:
            raise DatasetError(f"cannot decode image {path}: {exc}") from None
        labels.append(label)
    x = np.stack(arrays)
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x), np.asarray(labels, dtype=np.int64), size, mode


def _tree_key(root: Path, classes: list[str]) -> str:
    """A version key of an ImageFolder tree: where it is, and each class folder's time and size."""
    parts = [str(root.resolve())]
    for split in ("train", "test"):
        for name in classes:
            folder = root / split / name
            if folder.is_dir():
                stat = folder.stat()
                parts.append(f"{split}/{name}:{stat.st_mtime_ns}:{sum(1 for _ in folder.iterdir())}")
    return "|".join(parts)


def load_imagefolder(path: str | Path) -> Dataset:
    """Any ImageFolder tree: ``train/<class>/*`` and ``test/<class>/*``, classes sorted by name.

    Images are decoded once to uint8 arrays cached on disk (memory-mapped, so processes share
    them: ``_cached``). Images of a different size than the first are resized to it.
    """
    root = Path(path)
    if not root.is_dir():
        raise DatasetError(f"dataset path {root} does not exist: give a folder with train/<class>/ and test/<class>/")
    root = _find_tree(root)
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    if not classes:
        raise DatasetError(f"{root / 'train'} has no class folders")
    unknown = sorted({p.name for p in (root / "test").iterdir() if p.is_dir()} - set(classes))
    if unknown:
        raise DatasetError(f"{root / 'test'} has classes missing from train/: {unknown}")

    def build() -> Arrays:
        train = _image_files(root / "train", classes)
        test = _image_files(root / "test", classes)
        if not train or not test:
            raise DatasetError(f"{root} has no images in train/ or test/ (looked for {sorted(IMAGE_SUFFIXES)})")
        train_x, train_y, size, mode = _decode(train, None, None)
        test_x, test_y, _, _ = _decode(test, size, mode)
        return train_x, train_y, test_x, test_y, classes

    dataset = _cached("imagefolder", _tree_key(root, classes), build, classes)
    return Dataset(**{**dataset.__dict__, "name": root.name})


# --- specs ------------------------------------------------------------------------------------
