"""A models module: your own model and dataset, registered by name (docs/extending.md).

    meshlearn simulate --models-module examples/my_models.py --model tiny-cnn --dataset templates

The same file works with `meshlearn node`, `meshlearn experiment` (key `models_module`),
`meshlearn provider` and `meshlearn request` (`--models-module`). Only a file you name is ever
loaded; nothing arriving over the network selects code.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from meshlearn.data import make_dataset, register_dataset
from meshlearn.models import register_model


@register_model("tiny-cnn")
def tiny_cnn(input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """Called with the dataset's (C, H, W) and class count; returns a fresh module."""
    channels, height, width = input_shape
    return nn.Sequential(
        nn.Conv2d(channels, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * height * width, num_classes),
    )


@register_dataset("templates")
def templates(path):
    """`templates` (path None) or `templates:N` (N training samples per class; a spec's path is
    whatever follows the colon). Ten noisy 8x8 class templates, the same for every seed and machine."""
    per_class = int(str(path)) if path is not None else 200
    rng = np.random.default_rng(0)
    centres = rng.random((10, 1, 8, 8), dtype=np.float32)

    def draw(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = np.repeat(np.arange(10), count)
        noise = rng.normal(0.0, 0.8, (len(labels), 1, 8, 8)).astype(np.float32)
        return np.clip(centres[labels] + noise, 0.0, 1.0), labels

    train_x, train_y = draw(per_class)
    test_x, test_y = draw(max(per_class // 4, 1))
    return make_dataset("templates", train_x, train_y, test_x, test_y, [f"t{i}" for i in range(10)])
