"""Loading a dataset by its spec, once per process: images (``data.datasets``) or text (``data.text``)."""

from __future__ import annotations

from meshlearn.data.datasets import (
    Dataset,
    load_cifar10,
    load_digits,
    load_idx,
    load_imagefolder,
    reshuffled,
)
from meshlearn.data.leaf import load_leaf
from meshlearn.data.specs import DATASETS, parse_spec, parse_synthetic
from meshlearn.data.synthetic import load_synthetic_spec
from meshlearn.data.text import (
    leaf_holds_text,
    load_leaf_text,
    load_pystdlib,
    load_text,
)
from meshlearn.data.vocabulary import VocabularyKind
from meshlearn.errors import DatasetError

_CACHE: dict[str, Dataset] = {}


def load_dataset(spec: str, reshuffle: int | None = None, context: int = 128,
                 vocabulary: VocabularyKind = "bytes", nodes: int | None = None, seed: int = 0,
                 whole: bool = True) -> Dataset:
    """The dataset a spec names (see ``data.specs``), loaded once per process; with ``reshuffle``,
    its train and test sets pooled and split again with that seed (``reshuffled``). A text
    dataset's samples are windows of ``context`` tokens of ``vocabulary`` (``data.vocabulary``).
    A generated dataset (``synthetic:ALPHA,BETA``) has one user per node of ``nodes``, drawn from
    ``seed`` (``data.synthetic``); not ``whole``: only the users a sample of it needs (each other one is
    generated when asked for: FedAvg's cohort path, a report's test set)."""
    kind, path = parse_spec(spec)
    key = f"{kind}:{path.resolve()}" if path else kind
    if kind in ("pystdlib", "text", "leaf"):  # a LEAF folder may hold text (Shakespeare)
        key = f"{key}|context:{context}|vocabulary:{vocabulary}"
    if kind == "synthetic":
        key = f"synthetic:{parse_synthetic(spec)}|nodes:{nodes}|seed:{seed}|whole:{whole}"
    if reshuffle is not None:
        shuffled = f"{key}|reshuffle:{reshuffle}"
        if shuffled not in _CACHE:
            _CACHE[shuffled] = reshuffled(load_dataset(spec, context=context, vocabulary=vocabulary, nodes=nodes,
                                                       seed=seed, whole=whole), reshuffle)
        return _CACHE[shuffled]
    if key in _CACHE:
        return _CACHE[key]
    if kind in DATASETS:
        dataset = DATASETS.get(kind)(path)
        if not isinstance(dataset, Dataset):
            raise DatasetError(f"dataset {kind}: its factory returned {type(dataset).__name__}, not a Dataset "
                               "(build one with meshlearn.data.make_dataset)")
    elif kind == "digits":
        dataset = load_digits()
    elif kind == "synthetic":
        dataset = load_synthetic_spec(spec, nodes, seed, whole)
    elif kind in ("fashion-mnist", "mnist"):
        dataset = load_idx(path, kind)
    elif kind == "leaf":
        dataset = load_leaf_text(path, context, vocabulary) if leaf_holds_text(path) else load_leaf(path)
    elif kind == "cifar10":
        dataset = load_cifar10(path)
    elif kind in ("pystdlib", "text"):
        dataset = load_pystdlib(context, vocabulary) if kind == "pystdlib" else load_text(path, context, vocabulary)
    else:
        dataset = load_imagefolder(path)
    _CACHE[key] = dataset
    return dataset
