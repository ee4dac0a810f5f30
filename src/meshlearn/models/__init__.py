"""Models: the built-in zoo and the registry that selects them by name."""

from meshlearn.models import zoo  # noqa: F401  (registers the built-ins)
from meshlearn.models.registry import MODELS, build_model, load_weights, model_names, register_model

__all__ = ["MODELS", "build_model", "load_weights", "model_names", "register_model"]
