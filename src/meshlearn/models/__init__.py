"""Models: the built-in zoo and the registry that selects them by name.

The registry loads without torch (a model name can be checked at once); the zoo is imported when
a built-in model is first built."""

from meshlearn.lazy import lazy_exports

_WHERE = {name: "registry" for name in ("BUILT_IN", "MODEL_FILE", "MODELS", "build_model", "load_weights",
                                         "model_names", "register_model", "save_weights")}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
