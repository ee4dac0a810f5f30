"""The model registry: built-in and user-registered models, selectable by name."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from meshlearn.errors import ModelError
from meshlearn.plugins import Registry

if TYPE_CHECKING:
    import torch
    from torch import nn

ModelFactory = Callable[[tuple[int, ...], int], "nn.Module"]
BUILT_IN = ("lenet", "mlp", "resnet18", "simplecnn")  # registered by meshlearn.models.zoo
LANGUAGE_MODELS = ("gpt-tiny", "gpt-small")  # registered by meshlearn.models.gpt
MODELS: Registry[ModelFactory] = Registry("model", ModelError, built_in={
    **{name: "meshlearn.models.zoo" for name in BUILT_IN}, **{name: "meshlearn.models.gpt" for name in LANGUAGE_MODELS}})


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator registering ``factory(input_shape, num_classes) -> nn.Module`` under ``name``."""
    return MODELS.register(name)


def model_names() -> list[str]:
    """Names of every registered model."""
    return MODELS.names()


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """A fresh model for inputs of ``input_shape`` ((C, H, W) images; (T,) token windows) and
    ``num_classes`` classes (a language model's: its vocabulary)."""
    if name in BUILT_IN and len(input_shape) != 3:
        raise ModelError(f"model {name} reads images (C, H, W), not samples of shape {tuple(input_shape)}: for "
                         f"text use {' or '.join(LANGUAGE_MODELS)}")
    return MODELS.get(name)(tuple(input_shape), num_classes)


def load_weights(model: nn.Module, path: str) -> None:
    """Load a safetensors file of ``model``'s state dict into it; ModelError names any mismatch.

    Safetensors holds raw tensors only (no pickle), so a file from anyone is safe to read.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (SafetensorError, OSError, ValueError) as exc:
        raise ModelError(f"weights file {path} is not a safetensors file: {exc}") from None
    state = model.state_dict()
    missing, extra = sorted(state.keys() - tensors.keys()), sorted(tensors.keys() - state.keys())
    if missing or extra:
        raise ModelError(f"weights file does not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, mine in state.items():
        theirs = tensors[name]
        if theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            raise ModelError(f"weights file does not fit the model: {name} is {theirs.dtype} {list(theirs.shape)}, "
                             f"the model has {mine.dtype} {list(mine.shape)}")
    model.load_state_dict(tensors)


MODEL_FILE = "model.safetensors"  # a run's final model (node 0's), in its results folder


def save_weights(tensors: "Mapping[str, torch.Tensor]", path: str | Path,
                 metadata: dict[str, str] | None = None) -> None:
    """Write a model's state (its ``state_dict``, or tensors by the same names) as a safetensors file:
    raw tensors, no pickle, read back by ``load_weights``; ``metadata`` (strings) goes in its header
    (a language model's vocabulary)."""
    from safetensors.torch import save_file

    save_file({name: tensor.detach().to("cpu").contiguous().clone() for name, tensor in tensors.items()}, str(path),
              metadata=metadata or None)
