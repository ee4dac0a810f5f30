"""A task's result on disk: the model (safetensors), its metrics (JSON), the task's settings (YAML),
the confusion matrix (PNG) and, for image data, the result model's predictions on test images (PNG)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from meshlearn.errors import MeshlearnError
from meshlearn.plots import fit_title, pyplot, text_colour_on

if TYPE_CHECKING:
    from meshlearn.data import Dataset

log = logging.getLogger(__name__)

MODEL_FILE = "model.safetensors"
METRICS_FILE = "metrics.json"
CONFUSION_FILE = "confusion.png"
TASK_FILE = "task.yaml"


def write_results(folder: Path, metrics: dict, model_bytes: bytes, plot: bool = True, title: str = "",
                  task: dict | None = None) -> None:
    """Write the model, the metrics, the task's settings (``task``, if given) and (``plot``) the
    confusion matrix, titled by what it shows (``confusion_title`` of ``title``, by default the
    folder's name); the model atomically so a reader never sees half of it. Providers keep no
    plot: the requester draws its own."""
    folder.mkdir(parents=True, exist_ok=True)
    if task is not None:
        (folder / TASK_FILE).write_text(yaml.safe_dump(task, sort_keys=False))
    tmp = folder / (MODEL_FILE + ".tmp")
    tmp.write_bytes(model_bytes)
    os.replace(tmp, folder / MODEL_FILE)
    (folder / METRICS_FILE).write_text(json.dumps(metrics, indent=2))
    if plot and metrics.get("confusion"):
        plot_confusion(metrics["confusion"], metrics.get("class_names") or [], folder / CONFUSION_FILE,
                       confusion_title(title or folder.resolve().name, metrics))


def confusion_title(name: str, metrics: dict) -> str:
    """What confusion.png shows, as its title: whose result (``name``: the task, and its model and
    data where known), the confusion matrix of how many test samples, and their accuracy."""
    samples = sum(sum(row) for row in metrics.get("confusion") or [])
    accuracy = metrics.get("accuracy")
    score = f", accuracy {accuracy:.3f}" if isinstance(accuracy, (int, float)) else ""
    return f"{name}: confusion matrix of the result model on {samples:,} test samples{score}"


def read_results(folder: Path) -> tuple[dict, bytes, dict | None] | None:
    """(metrics, model bytes, task settings or None) if the folder holds a complete result, else None."""
    model, metrics, task = folder / MODEL_FILE, folder / METRICS_FILE, folder / TASK_FILE
    if not (model.is_file() and metrics.is_file()):
        return None
    settings = yaml.safe_load(task.read_text()) if task.is_file() else None
    return json.loads(metrics.read_text()), model.read_bytes(), settings if isinstance(settings, dict) else None


def confusion_figure(confusion: list[list[int]], class_names: list[str], title: str):
    """The confusion matrix as a labelled heat map (rows true, columns predicted) titled ``title``;
    the caller saves and closes the matplotlib Figure."""
    plt = pyplot()

    n = len(confusion)
    labels = [str(c) for c in class_names] if len(class_names) == n else [str(i) for i in range(n)]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.5 + 0.55 * n), max(3.5, 1.2 + 0.5 * n)), layout="constrained")
    image = ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(n), labels, rotation=45, ha="right")
    ax.set_yticks(range(n), labels)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    for i, row in enumerate(confusion):
        for j, value in enumerate(row):
            ax.text(j, i, str(value), ha="center", va="center", fontsize=7,
                    color=text_colour_on(image.cmap(image.norm(value))))
    fig.colorbar(image, ax=ax, label="test samples")
    fit_title(fig, title, fontsize=10)
    return fig


def plot_confusion(confusion: list[list[int]], class_names: list[str], path: Path, title: str = "") -> None:
    """Save the confusion matrix heat map (see :func:`confusion_figure`) as a PNG."""
    plt = pyplot()

    fig = confusion_figure(confusion, class_names, title or path.parent.resolve().name)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_predictions(folder: Path, dataset: Dataset, model_name: str, limit: int = 0, title: str = "") -> bool:
    """Save predictions.png beside the result in ``folder``: the result model (``model_name`` built
    for ``dataset``, its weights from model.safetensors) on the test images an evaluation limited
    to ``limit`` samples shows (``evaluation.shown_samples``). False, writing nothing, for data that
    is not images, or a model that does not load (logged: the task's result stands without it)."""
    from meshlearn.evaluation import PREDICTIONS_FIGURE, is_image, shown_predictions, write_predictions
    from meshlearn.models import build_model, load_weights

    if not is_image(dataset):
        return False
    try:
        model = build_model(model_name, dataset.input_shape, dataset.num_classes)
        load_weights(model, str(folder / MODEL_FILE))
    except MeshlearnError as exc:
        log.warning("no %s: %s", PREDICTIONS_FIGURE, exc)
        return False
    title = f"{title or folder.resolve().name}: the result model"
    return write_predictions(folder / PREDICTIONS_FIGURE, dataset, shown_predictions(model, dataset, limit=limit),
                             title, limit)
