"""The local baseline's declaration: no exchange. Its runtimes: ``node.algorithms.base.LocalOnly``
and ``batched.algorithms.local``."""

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import ALL_SCHEMES, Needs


@register_algorithm
class LocalDefinition(Definition):
    """Each node trains alone."""

    name = "local"
    summary = "no exchange: each node trains alone, a baseline"
    needs = Needs(endpoint="none", lossy=True, sharing=ALL_SCHEMES, robust=True, byzantine=True, torchrun=True)
