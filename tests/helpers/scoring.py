"""Score a network task's result ourselves: the returned model loaded into a plain PyTorch model."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from meshlearn.data import load_dataset
from meshlearn.models import build_model
from meshlearn.node import evaluate_model


def score_result(folder: Path, model: str = "mlp", dataset: str = "digits") -> float:
    """Test accuracy of ``folder/model.safetensors`` on the whole test set."""
    data = load_dataset(dataset)
    net = build_model(model, data.input_shape, data.num_classes)
    net.load_state_dict(load_file(str(folder / "model.safetensors")))
    return evaluate_model(net, data).accuracy
