"""Built-in models: exact sizes, and they adapt to the data's shape."""

import pytest
import torch
from torch import nn

from meshlearn.errors import ModelError
from meshlearn.models import build_model, model_names, register_model


def _count(model):
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, count", [("lenet", 89_834), ("simplecnn", 1_147_466), ("resnet18", 11_173_962)])
def test_parameter_counts_on_cifar(name, count):
    assert _count(build_model(name, (3, 32, 32), 10)) == count


@pytest.mark.parametrize("name", ["mlp", "lenet", "simplecnn", "resnet18"])
@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28), (1, 8, 8)])
def test_forward_backward_on_every_shape(name, shape):
    model = build_model(name, shape, 7)
    out = model(torch.randn(2, *shape))
    assert out.shape == (2, 7)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_unknown_model_and_registration():
    with pytest.raises(ModelError, match="unknown model 'vgg'.*lenet"):
        build_model("vgg", (3, 32, 32), 10)

    @register_model("tiny-test")
    def tiny(shape, classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(shape[0] * shape[1] * shape[2], classes))

    assert "tiny-test" in model_names()
    assert build_model("tiny-test", (1, 8, 8), 3)(torch.randn(1, 1, 8, 8)).shape == (1, 3)
