"""The model registry: built-in and user-registered models, selectable by name."""

from __future__ import annotations

from typing import Callable

from torch import nn

from meshlearn.errors import ModelError

ModelFactory = Callable[[tuple[int, int, int], int], nn.Module]
MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Decorator registering ``factory(input_shape, num_classes) -> nn.Module`` under ``name``."""

    def decorate(factory: ModelFactory) -> ModelFactory:
        MODELS[name] = factory
        return factory

    return decorate


def model_names() -> list[str]:
    """Names of every registered model."""
    return sorted(MODELS)


def build_model(name: str, input_shape: tuple[int, int, int], num_classes: int) -> nn.Module:
    """A fresh model for inputs of ``input_shape`` (C, H, W) and ``num_classes`` classes."""
    factory = MODELS.get(name)
    if factory is None:
        raise ModelError(f"unknown model {name!r}: choose one of {', '.join(model_names())}")
    return factory(tuple(input_shape), num_classes)
