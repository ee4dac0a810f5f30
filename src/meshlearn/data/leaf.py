"""LEAF datasets (FEMNIST and its kin): per-writer JSON files, read into images with each training
sample's writer (``train_groups``, for the ``writers`` partition); ``data.text`` reads LEAF's text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from meshlearn.data.datasets import Dataset, _cached, _file_key
from meshlearn.data.specs import require_path
from meshlearn.errors import DatasetError

MAX_LEAF_FILE = 2 * 1024 ** 3  # bytes of one LEAF JSON file (FEMNIST's are about 100 MB)
MAX_LEAF_CLASSES = 10_000  # FEMNIST has 62; a label beyond this is a broken file, not a class list to build


def leaf_records(folder: Path) -> Iterator[tuple[Path, str, Any]]:
    """Every writer's record in ``folder``'s LEAF JSON files, in file and writer order, as
    (file, writer, record); DatasetError for a file that is not LEAF JSON."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise DatasetError(f"{folder} holds no .json files: give a LEAF folder with train/ and test/ of LEAF JSON")
    for path in files:
        if path.stat().st_size > MAX_LEAF_FILE:
            raise DatasetError(f"{path} is larger than {MAX_LEAF_FILE} bytes: not a LEAF file")
        try:
            data = json.loads(path.read_text())
            users, user_data = data["users"], data["user_data"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise DatasetError(f"{path} is not a LEAF file (JSON with users and user_data): {exc}") from None
        if not isinstance(users, list) or not all(isinstance(u, str) for u in users) or not isinstance(user_data, dict):
            raise DatasetError(f"{path} is not a LEAF file: users must be a list of names and user_data a map "
                               "from each name to its samples")
        for user in users:
            yield path, user, user_data.get(user)


def _read_leaf_split(folder: Path) -> tuple[list[np.ndarray], list[np.ndarray], list[str]]:
    """Every writer's samples (x, y) in ``folder``'s LEAF JSON files, in file and writer order."""
    xs, ys, writers = [], [], []
    for path, user, record in leaf_records(folder):
        try:
            x = np.asarray(record["x"], dtype=np.float32)
            y = np.asarray(record["y"], dtype=np.int64)
        except (KeyError, TypeError, ValueError):
            raise DatasetError(f"{path}: writer {user!r} has no numeric x and y lists") from None
        if x.ndim != 2 or y.ndim != 1 or len(x) != len(y) or not len(y):
            raise DatasetError(f"{path}: writer {user!r} needs as many samples (x, flat pixel lists of one "
                               f"length) as labels (y); got x {list(x.shape)}, y {list(y.shape)}")
        xs.append(x)
        ys.append(y)
        writers.append(str(user))
    return xs, ys, writers


def leaf_folders(root: Path) -> list[Path]:
    """A LEAF folder's ``train/`` and ``test/``; DatasetError where either is missing."""
    require_path(root, "leaf")
    folders = [root / "train", root / "test"]
    for folder in folders:
        if not folder.is_dir():
            raise DatasetError(f"{root} has no {folder.name}/ folder: give a LEAF folder with train/ and test/")
    return folders


def load_leaf(path: str | Path) -> Dataset:
    """A LEAF dataset (FEMNIST's per-writer JSON: ``train/*.json``, ``test/*.json``, each with
    ``users`` and ``user_data: {user: {x: [[pixels]], y: [labels]}}``), square grey images of
    pixels in 0..1, decoded once into the cache; ``train_groups`` says each training sample's
    writer, for the ``writers`` partition."""
    root = Path(path)
    folders = leaf_folders(root)

    def build():
        (train_x, train_y, writers), (test_x, test_y, _) = (_read_leaf_split(f) for f in folders)
        width = {x.shape[1] for x in train_x + test_x}
        side = int(round(next(iter(width)) ** 0.5))
        if len(width) != 1 or side * side != next(iter(width)):
            raise DatasetError(f"{root}: samples must be square images of one size; their lengths are {sorted(width)}")
        def to_images(parts: list[np.ndarray]) -> np.ndarray:
            pixels = np.clip(np.rint(np.concatenate(parts) * 255), 0, 255).astype(np.uint8)
            return pixels.reshape(-1, 1, side, side)

        labels = np.concatenate(train_y + test_y)
        if labels.min() < 0 or labels.max() >= MAX_LEAF_CLASSES:
            raise DatasetError(f"{root}: labels must lie in 0 .. {MAX_LEAF_CLASSES - 1}; found {labels.min()} .. "
                               f"{labels.max()}")
        groups = np.concatenate([np.full(len(y), i, dtype=np.int64) for i, y in enumerate(train_y)])
        classes = [str(c) for c in range(int(labels.max()) + 1)]
        return to_images(train_x), np.concatenate(train_y), to_images(test_x), np.concatenate(test_y), groups, classes

    key = _file_key(*sorted(root.glob("train/*.json")), *sorted(root.glob("test/*.json")))
    return _cached("leaf", key, build, extras=("train_groups",))
