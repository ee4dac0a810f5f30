"""Data: dataset specs, datasets, seeded partitioners, per-node batch loaders.

Names are imported on first use: ``data.specs`` checks a dataset spec without loading torch."""

from meshlearn.data.partition import (  # eager: partition shares its module's name
    Partition,
    partition,
    partition_dataset,
)
from meshlearn.lazy import lazy_exports

_WHERE = {
    **{name: "datasets" for name in ("Dataset", "load_cifar10", "load_digits", "load_idx",
                                      "load_imagefolder", "make_dataset",
                                      "reshuffled", "shard_as_test_set", "split_validation", "test_samples")},
    "load_leaf": "leaf",
    **{name: "synthetic" for name in ("SyntheticPopulation", "load_synthetic", "require_materialized")},
    "ShardLoader": "loader", "ShardLoaders": "loader", "loader_seed": "loader", "parse_spec": "specs",
    "register_dataset": "specs", "load_dataset": "loading",
}
__all__ = sorted(_WHERE) + ["Partition", "partition", "partition_dataset"]

__getattr__ = lazy_exports(__name__, _WHERE)
