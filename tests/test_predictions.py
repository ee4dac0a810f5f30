"""The report's evaluation pictures (predictions.png: test images with their true and predicted
labels, wrong ones in red) and ``reshuffle`` (train and test pooled and split again per seed)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from meshlearn.config import ExperimentConfig
from meshlearn.data import load_dataset, make_dataset, reshuffled
from meshlearn.errors import DatasetError
from meshlearn.evaluation import (
    PREDICTIONS_FIGURE,
    RIGHT,
    WRONG,
    is_image,
    predictions_figure,
    shown_predictions,
    shown_samples,
    write_predictions,
)
from meshlearn.metrics import SHOWN_COLUMNS, SHOWN_ROWS
from meshlearn.topology import build_topology

SHOWN = SHOWN_ROWS * SHOWN_COLUMNS


class Always(nn.Module):
    """A model that predicts class ``label`` for every sample."""

    def __init__(self, label: int, classes: int = 10):
        super().__init__()
        self.label, self.classes = label, classes

    def forward(self, x):
        logits = torch.zeros(len(x), self.classes)
        logits[:, self.label] = 1.0
        return logits


def _colour(text) -> tuple:
    from matplotlib.colors import to_rgba

    return to_rgba(text.get_color())


def _png_size(path) -> tuple[int, int]:
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        return image.size


def test_the_grid_marks_every_wrong_prediction_red_and_every_right_one_green():
    from matplotlib.colors import to_rgba

    digits = load_dataset("digits")
    images, labels = shown_samples(digits)
    predicted = shown_predictions(Always(3), digits)
    assert predicted == [3] * SHOWN and len(labels) == SHOWN
    fig = predictions_figure(digits, images, labels, predicted, "always 3")
    tiles = [ax for ax in fig.axes if ax.images]
    assert len(tiles) == SHOWN
    wrong = 0
    for ax, label in zip(tiles, labels.tolist()):
        colour = to_rgba(WRONG if label != 3 else RIGHT)
        assert _colour(ax.title) == colour and ax.title.get_text() == f"true {label}\npred 3"
        assert all(spine.get_edgecolor() == colour for spine in ax.spines.values())
        wrong += label != 3
    assert 0 < wrong < SHOWN  # the evenly spaced samples hold some 3s and some others
    assert f"{wrong} of {SHOWN} test images predicted wrongly" in fig._suptitle.get_text()
    # the images drawn are the stored ones, not the normalized inputs: digits' pixels lie in 0..1
    drawn = tiles[0].images[0].get_array()
    assert np.allclose(drawn, images[0, 0].numpy()) and drawn.min() >= 0


def test_class_names_label_the_tiles_and_a_flat_feature_dataset_gets_no_picture(tmp_path):
    rng = np.random.default_rng(0)
    pictures = make_dataset("pics", rng.integers(0, 255, (30, 3, 6, 6), dtype=np.uint8), [0, 1] * 15,
                            rng.integers(0, 255, (8, 3, 6, 6), dtype=np.uint8), [0, 1] * 4, ["cat", "dog"])
    assert is_image(pictures)
    assert write_predictions(tmp_path / "p.png", pictures, [1] * 8, "pics")
    images, labels = shown_samples(pictures)
    fig = predictions_figure(pictures, images, labels, [1] * 8, "pics")
    titles = [ax.title.get_text() for ax in fig.axes if ax.images]
    assert titles[:2] == ["true cat\npred dog", "true dog\npred dog"]
    flat = make_dataset("flat", rng.random((30, 12, 1, 1), dtype=np.float32), [0, 1] * 15,
                        rng.random((8, 12, 1, 1), dtype=np.float32), [0, 1] * 4, ["a", "b"])
    assert not is_image(flat)
    assert not write_predictions(tmp_path / PREDICTIONS_FIGURE, flat, [0] * 8, "flat")
    assert not (tmp_path / PREDICTIONS_FIGURE).exists()


def _simulate(tmp_path, *flags: str) -> tuple[subprocess.CompletedProcess, object]:
    output = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--dataset", "digits", "--model", "mlp",
                           "--nodes", "3", "--topology", "full", "--iterations", "30", "--test-after", "30",
                           "--output", str(output), *flags], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, output


@pytest.mark.parametrize("engine", ["process", "batched"])
def test_a_simulate_run_writes_predictions_png_of_its_median_node(tmp_path, engine):
    proc, output = _simulate(tmp_path, "--engine", engine)
    path = output / PREDICTIONS_FIGURE
    width, height = _png_size(path)
    assert width > 600 and height > 400 and width > height  # a 4 x 6 grid, wider than tall
    assert "predictions.png" in proc.stdout.splitlines()[-1]
    summary = json.loads((output / "summary.json").read_text())
    shown = [n["metrics"]["shown"] for n in summary["per_node"].values()]
    assert all(len(s) == SHOWN for s in shown)  # every node's final evaluation kept its predictions


def test_a_network_result_gets_predictions_png_from_its_model(tmp_path):
    from safetensors.torch import save_file

    from meshlearn.models import build_model
    from meshlearn.network.task.results import MODEL_FILE, plot_predictions

    digits = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", digits.input_shape, digits.num_classes)
    save_file(model.state_dict(), str(tmp_path / MODEL_FILE))
    assert plot_predictions(tmp_path, digits, "mlp", limit=100, title="task abc")
    width, height = _png_size(tmp_path / PREDICTIONS_FIGURE)
    assert width > height > 400
    (tmp_path / MODEL_FILE).write_bytes(b"not a model")  # a result that does not load: no picture, no error
    (tmp_path / PREDICTIONS_FIGURE).unlink()
    assert not plot_predictions(tmp_path, digits, "mlp")
    assert not (tmp_path / PREDICTIONS_FIGURE).exists()


# --- reshuffle ---------------------------------------------------------------------------------

def _rows(x: torch.Tensor) -> set[bytes]:
    return {row.numpy().tobytes() for row in x}


def test_reshuffle_splits_the_pool_again_the_same_way_for_the_same_seed():
    digits = load_dataset("digits")
    one, again, other = reshuffled(digits, 1), reshuffled(digits, 1), reshuffled(digits, 2)
    assert torch.equal(one.test_x, again.test_x) and torch.equal(one.train_y, again.train_y)
    assert not torch.equal(one.test_x, other.test_x)
    assert not torch.equal(one.test_x, digits.test_x)
    for split in (one, other):
        assert len(split.train_y) == len(digits.train_y) and len(split.test_y) == len(digits.test_y)
        train, test = _rows(split.train_x), _rows(split.test_x)
        assert not train & test  # digits has no duplicate images
        assert train | test == _rows(digits.train_x) | _rows(digits.test_x)
        # stratified: each class keeps its share of the test set (within one sample)
        stored = torch.bincount(digits.test_y, minlength=10)
        assert (torch.bincount(split.test_y, minlength=10) - stored).abs().max() <= 1
        # every image keeps its label
        pool = dict(zip(_keys(digits.train_x, digits.test_x), torch.cat([digits.train_y, digits.test_y]).tolist()))
        assert all(pool[k] == y for k, y in zip(_keys(split.test_x), split.test_y.tolist()))
        assert split.mean == digits.mean and split.std == digits.std


def _keys(*tensors: torch.Tensor) -> list[bytes]:
    return [row.numpy().tobytes() for x in tensors for row in x]


def test_reshuffle_refuses_a_dataset_split_by_writer():
    digits = load_dataset("digits")
    grouped = type(digits)(**{**digits.__dict__, "train_groups": torch.zeros(len(digits.train_y), dtype=torch.int64)})
    with pytest.raises(DatasetError, match="writer"):
        reshuffled(grouped, 1)


def test_both_engines_train_and_test_on_the_reshuffled_split_only_when_asked(tmp_path):
    from meshlearn.batched import BatchedSimulation
    from meshlearn.cli.main import _resolve, build_parser
    from meshlearn.node import build_node, load_run_dataset

    digits = load_dataset("digits")
    plain = ExperimentConfig(dataset="digits", model="mlp", nodes=2, topology="full", seed=7)
    assert load_run_dataset(plain) is digits  # without reshuffle: the dataset as stored, as before
    args = build_parser().parse_args(["simulate", "--reshuffle", "true", "--seed", "7"])
    assert _resolve(args).reshuffle is True
    config = plain.model_copy(update={"reshuffle": True})
    expected = reshuffled(digits, 7)
    graph = build_topology("full", 2, 7)
    node = build_node(config, 0, graph)
    assert torch.equal(node.dataset.test_x, expected.test_x) and torch.equal(node.loader.dataset.train_y,
                                                                            expected.train_y)
    run = BatchedSimulation(config.model_copy(update={"engine": "batched"}), graph, tmp_path)._build()
    assert torch.equal(run.dataset.test_x, expected.test_x) and torch.equal(run.dataset.train_y, expected.train_y)
    assert torch.equal(build_node(plain, 0, graph).dataset.test_x, digits.test_x)


def test_an_experiment_file_reshuffles_each_seed_with_its_own_seed(tmp_path):
    from meshlearn.node import load_run_dataset
    from meshlearn.sim.experiment import load_experiment

    path = tmp_path / "spread.yaml"
    path.write_text("base: {dataset: digits, reshuffle: true}\nruns:\n  - {name: a, seeds: [1, 2]}\n")
    runs = load_experiment(path, quick=False, output=tmp_path / "out").runs
    assert [(name, config.reshuffle, config.seed) for name, config in runs] == [("a-s1", True, 1), ("a-s2", True, 2)]
    first, second = (load_run_dataset(config) for _, config in runs)
    assert torch.equal(first.test_x, reshuffled(load_dataset("digits"), 1).test_x)
    assert not torch.equal(first.test_x, second.test_x)
