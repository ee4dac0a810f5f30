"""A model's test-set metrics (``evaluate_model``: its dataset's task turns the model's outputs into an
``Evaluation`` of ``meshlearn.metrics``), and the predictions on a grid of test images (predictions.png)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from meshlearn.data import Dataset, test_samples
from meshlearn.metrics import SHOWN_COLUMNS, Evaluation, shown_positions
from meshlearn.plots import fit_title, pyplot
from meshlearn.tasks import task_of

EVAL_BATCH = 128  # test samples per forward pass: bounds a node's activations (LeNet: 17 MB a layer)


@torch.no_grad()
def evaluate_model(model: nn.Module, dataset: Dataset, device: torch.device | str = "cpu",
                   limit: int = 0, full: bool = False) -> Evaluation:
    """A model's loss and accuracy on the test set (``limit`` samples of it, ``test_samples``; 0 =
    all); all metrics if ``full``. The dataset's task measures them (``meshlearn.tasks``)."""
    task = task_of(dataset)
    xs, ys = test_samples(dataset, limit)
    model.eval()
    total_loss = 0.0
    preds = []
    for start in range(0, len(ys), EVAL_BATCH):
        x = dataset.normalize(xs[start:start + EVAL_BATCH]).to(device)
        y = ys[start:start + EVAL_BATCH].to(device)
        outputs = model(x)
        total_loss += float(task.loss_sum(outputs, y))
        preds.append(task.predictions(outputs).flatten().cpu())
    return task.evaluation(total_loss, ys, torch.cat(preds), dataset.num_classes, full)


# --- predictions.png: a grid of test images with their true and predicted labels ------------------

PREDICTIONS_FIGURE = "predictions.png"
RIGHT, WRONG = "#1a7f37", "#d1242f"  # the colours of a right and a wrong prediction's title (and frame)


def is_image(dataset: Dataset) -> bool:
    """Whether a dataset's samples are pictures worth showing: one (grey) or three (RGB) channels of
    at least 4 x 4 pixels; ``digits`` (8 x 8) is one, a flat feature vector (N, F, 1, 1) is not,
    nor is text."""
    if len(dataset.input_shape) != 3 or dataset.tokens:
        return False
    channels, height, width = dataset.input_shape
    return channels in (1, 3) and height >= 4 and width >= 4


def shown_samples(dataset: Dataset, limit: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The test samples (raw images, labels) predictions.png shows, out of those an evaluation
    limited to ``limit`` samples uses (``test_samples``)."""
    xs, ys = test_samples(dataset, limit)
    chosen = shown_positions(len(ys))
    return xs[chosen], ys[chosen]


@torch.no_grad()
def shown_predictions(model: nn.Module, dataset: Dataset, device: torch.device | str = "cpu",
                      limit: int = 0) -> list[int]:
    """The model's predicted classes of ``shown_samples`` (what a final Evaluation's ``shown`` holds)."""
    xs, _ = shown_samples(dataset, limit)
    model.eval()
    return model(dataset.normalize(xs).to(device)).argmax(1).cpu().tolist()


def predictions_figure(dataset: Dataset, images: torch.Tensor, labels, predicted, title: str):
    """The grid of ``images`` (raw samples of ``dataset``, as stored) each titled with its true and
    predicted class (the dataset's class names); a wrong prediction's title and frame are red. The
    caller saves and closes the matplotlib Figure."""
    plt = pyplot()

    labels, predicted = [int(y) for y in labels], [int(p) for p in predicted]
    names = list(dataset.class_names) if len(dataset.class_names) == dataset.num_classes else []
    name = (lambda c: names[c]) if names else str
    pixels = images.to(torch.float32) / (255.0 if images.dtype == torch.uint8 else 1.0)  # stored 0..255 or 0..1
    columns = min(SHOWN_COLUMNS, max(1, len(labels)))
    rows = max(1, -(-len(labels) // columns))
    fig, axes = plt.subplots(rows, columns, figsize=(1.7 * columns, 1.9 * rows + 0.6), squeeze=False)
    for k, ax in enumerate(axes.flat):
        ax.set_xticks([])
        ax.set_yticks([])
        if k >= len(labels):
            ax.set_axis_off()
            continue
        picture = pixels[k].clamp(0, 1).permute(1, 2, 0).numpy()
        ax.imshow(picture[:, :, 0] if picture.shape[2] == 1 else picture, cmap="gray", vmin=0, vmax=1)
        wrong = labels[k] != predicted[k]
        colour = WRONG if wrong else RIGHT
        ax.set_title(f"true {name(labels[k])}\npred {name(predicted[k])}",
                     fontsize=8, color=colour)
        for spine in ax.spines.values():
            spine.set_edgecolor(colour)
            spine.set_linewidth(3 if wrong else 1)
    errors = sum(y != p for y, p in zip(labels, predicted))
    fit_title(fig, f"{title}\n{errors} of {len(labels)} test images predicted wrongly (red)", fontsize=9)
    fig.tight_layout()
    return fig


def write_predictions(path: Path, dataset: Dataset, predicted, title: str, limit: int = 0) -> bool:
    """Save predictions.png of ``predicted`` (the classes of ``shown_samples(dataset, limit)``) at
    ``path``; False, writing nothing, for a dataset whose samples are not images (``is_image``)."""
    if not is_image(dataset):
        return False
    images, labels = shown_samples(dataset, limit)
    if len(predicted) != len(labels):
        raise ValueError(f"{len(predicted)} predictions for {len(labels)} shown test samples")
    plt = pyplot()
    fig = predictions_figure(dataset, images, labels, predicted, title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
