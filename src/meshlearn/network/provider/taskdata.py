"""A provider's data for a task: its shard and the test set, served by the requester or held locally."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from meshlearn.data import Dataset, load_dataset, partition_dataset
from meshlearn.errors import BadMessage
from meshlearn.network.task.datashare import dataset_from_shards, download, read_shard
from meshlearn.network.task.spec import TaskSpec


def task_dataset(spec: TaskSpec, index: int, folder: Path, secret: bytes, sender: str, data_root: Path | None,
                 before_chunk: Callable[[], None] | None = None) -> tuple[Dataset, list[int]]:
    """The dataset provider ``index`` trains on and the indices of its shard in it (``spec.shard_of``).

    Served data is downloaded into ``folder`` (``before_chunk`` runs before every chunk: what it
    raises ends the download); local data must lie under ``data_root``.
    """
    data = spec.data
    mode = data.get("mode")
    shard_index = spec.shard_of(index)
    if mode == "served":
        address, files = str(data.get("address", "")), data.get("files")
        name = f"shard-{shard_index}.safetensors"
        if not isinstance(files, dict) or name not in files or "test.safetensors" not in files or spec.meta is None:
            raise BadMessage("served data must list this provider's shard and test.safetensors, with meta")
        shard, test = (download(address, file, files[file], folder, secret, sender=sender, before_chunk=before_chunk)
                       for file in (name, "test.safetensors"))
        dataset = dataset_from_shards(spec.meta, read_shard(shard), read_shard(test))
        if dataset.tokens and dataset.input_shape != (spec.context,):
            raise BadMessage(f"the task's token windows are {dataset.input_shape[0]} long, not its context "
                             f"{spec.context}")
        return dataset, list(range(len(dataset.train_y)))
    if mode == "local":
        dataset = load_dataset(allowed_local(str(data.get("dataset", "")), data_root), context=spec.context,
                               vocabulary=spec.vocabulary)
        parts = partition_dataset(dataset, spec.shards, spec.partition, spec.seed)
        return dataset, parts[shard_index]
    raise BadMessage(f"data mode {mode!r} is not served or local")


def allowed_local(dataset: str, root: Path | None) -> str:
    """A dataset on this machine, only inside the folder the operator allowed (``--data-root``)."""
    kind, sep, path = dataset.partition(":")
    if not sep:
        return dataset  # an embedded dataset such as digits
    if root is None:
        raise BadMessage("this provider serves no local data: its operator did not pass --data-root")
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise BadMessage(f"local data {path!r} is outside this provider's data root")
    return f"{kind}:{resolved}"
