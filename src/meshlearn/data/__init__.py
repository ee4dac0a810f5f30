"""Data: datasets, seeded partitioners, per-node batch loaders."""

from meshlearn.data.datasets import (
    Dataset, load_cifar10, load_dataset, load_digits, load_idx, load_imagefolder,
)
from meshlearn.data.loader import ShardLoader
from meshlearn.data.partition import partition

__all__ = [
    "Dataset", "ShardLoader", "load_cifar10", "load_dataset", "load_digits", "load_idx", "load_imagefolder",
    "partition",
]
