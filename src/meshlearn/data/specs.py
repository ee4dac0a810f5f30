"""Dataset specs (``digits``, ``cifar10:PATH``, ...): parsed and checked without loading anything,
so a wrong name or path is reported before a run starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from meshlearn.errors import DatasetError
from meshlearn.plugins import Registry
from meshlearn.suggest import did_you_mean

if TYPE_CHECKING:
    from meshlearn.data.datasets import Dataset

DatasetFactory = Callable[["Path | None"], "Dataset"]
# Datasets a user's module registers (``register_dataset``); the built-in ones are KINDS below.
DATASETS: Registry[DatasetFactory] = Registry("dataset", DatasetError)

VocabularyKind = Literal["bytes", "chars"]  # a language model's tokens (data.vocabulary)
VOCABULARY_HELP = ("text datasets: bytes (256 tokens, every byte of the UTF-8 text) | chars (the characters of the "
                   "training text, at most 255, the most frequent, and one token for any other)")

IMAGE_KINDS = ("digits", "fashion-mnist", "mnist", "cifar10", "imagefolder", "synthetic")  # datasets that hold no text

SPECS = ("digits, fashion-mnist:DIR, mnist:DIR, cifar10:PATH, imagefolder:DIR, leaf:DIR, pystdlib, text:PATH, "
         "synthetic:ALPHA,BETA")
# The name a spec starts with -> the dataset it means (and whether it needs a path)
KINDS = {"digits": ("digits", False), "fashion-mnist": ("fashion-mnist", True), "fmnist": ("fashion-mnist", True),
         "fashion_mnist": ("fashion-mnist", True), "mnist": ("mnist", True), "cifar10": ("cifar10", True),
         "cifar-10": ("cifar10", True), "imagefolder": ("imagefolder", True), "leaf": ("leaf", True),
         "femnist": ("leaf", True), "pystdlib": ("pystdlib", False), "text": ("text", True),
         "synthetic": ("synthetic", True)}  # its "path" is its parameters, ALPHA,BETA (parse_synthetic)

_IDX = "the folder holding train-images-idx3-ubyte.gz and the other IDX files"
WHAT = {"fashion-mnist": _IDX, "mnist": _IDX,
        "cifar10": "the folder of the CIFAR-10 python batches, an ImageFolder tree (train/<class>/, test/<class>/) "
                   "or its .tar.gz",
        "imagefolder": "a folder with train/<class>/ and test/<class>/",
        "leaf": "a LEAF folder (FEMNIST or Shakespeare) with train/*.json and test/*.json",
        "text": "a text file, or a folder of .txt files"}
# Where each dataset on disk comes from, said with a missing path (nothing is ever downloaded at run time)
GET = {"fashion-mnist": "https://github.com/zalandoresearch/fashion-mnist (its four .gz files in one folder; Debian: "
                        "apt install dataset-fashion-mnist)",
       "mnist": "https://yann.lecun.com/exdb/mnist/ (its four .gz files in one folder)",
       "cifar10": "https://www.cs.toronto.edu/~kriz/cifar.html (the python version, cifar-10-python.tar.gz, "
                  "read as it comes)",
       "leaf": "https://github.com/TalwalkarLab/leaf (its FEMNIST and Shakespeare preprocessing write train/ and "
                "test/)"}


def register_dataset(name: str) -> Callable[[DatasetFactory], DatasetFactory]:
    """Decorator registering ``factory(path) -> Dataset`` as dataset ``name``: the spec ``name``
    calls it with None, ``name:PATH`` with the path (``meshlearn.data.make_dataset`` builds one)."""
    if name.strip().lower() in KINDS:
        raise DatasetError(f"dataset name {name!r} is built in: choose another name")
    return DATASETS.register(name)


def parse_spec(spec: str) -> tuple[str, Path | None]:
    """The dataset a spec names and its path; DatasetError for an unknown name or a missing path."""
    name, _, path = spec.partition(":")
    if name in DATASETS:  # a user's dataset: its factory checks its own path
        return name, Path(path).expanduser() if path else None
    kind = KINDS.get(name.strip().lower())
    if kind is None:
        custom = f"; registered: {', '.join(DATASETS.names())}" if DATASETS.names() else \
            " (or register your own: --models-module FILE)"
        raise DatasetError(f"unknown dataset {spec!r}: {did_you_mean(name, [*KINDS, *DATASETS.names()])}use one of "
                           f"{SPECS}{custom}")
    if kind[0] == "synthetic":
        parse_synthetic(spec)
        return kind[0], None
    if kind[1] and not path:
        raise DatasetError(f"{name} needs a folder: {name}:DIR ({WHAT[kind[0]]})")
    if path and not kind[1]:
        raise DatasetError(f"{name} is built in and takes no path: write {name}")
    if not path:
        return kind[0], None
    where = Path(path).expanduser()
    require_path(where, kind[0])
    return kind[0], where


def require_path(root: Path, kind: str) -> None:
    """DatasetError saying what to give when a dataset's path does not exist."""
    if not root.exists():
        get = f"; get it from {GET[kind]}" if kind in GET else ""
        raise DatasetError(f"dataset path {root} does not exist: give {WHAT[kind]}{get}")


def parse_synthetic(spec: str) -> tuple[float, float]:
    """``"synthetic:1,0.5"`` -> (1.0, 0.5): the FedProx paper's synthetic(ALPHA, BETA) data set's two
    parameters (``data.synthetic``); DatasetError unless both are numbers >= 0."""
    _, _, arguments = spec.partition(":")
    parts = arguments.split(",")
    try:
        alpha, beta = (float(part) for part in parts)
    except ValueError:
        alpha = beta = float("nan")
    if not (0 <= alpha < float("inf") and 0 <= beta < float("inf")):
        raise DatasetError(f"dataset {spec!r}: synthetic takes two numbers >= 0, synthetic:ALPHA,BETA (how far "
                           "users' models and their inputs differ), e.g. synthetic:1,1 or synthetic:0,0")
    return alpha, beta
