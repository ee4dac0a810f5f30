"""D-PSGD's declaration (Lian et al. 2017). Its runtimes: ``algorithms.dpsgd`` (process engine)
and ``batched.algorithms.dpsgd``, which add what a ``RoundAlgorithm`` does not yet express: lost
UDP chunks, robust rules, attacks and sharing schemes."""

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import ALL_SCHEMES, Needs
from meshlearn.definitions.settings import DpsgdSettings


@register_algorithm
class DpsgdDefinition(Definition):
    """Synchronous decentralized SGD: average with the neighbours after the local steps."""

    name = "dpsgd"
    summary = "synchronous: Metropolis-Hastings average with the neighbours after the local steps"
    needs = Needs(lossy=True, sharing=ALL_SCHEMES, robust=True, byzantine=True, dynamic=True, torchrun=True,
                  network=True)
    settings = DpsgdSettings
