"""A user's algorithm in one file: D-PSGD that moves only halfway toward the neighbours' average.

    meshlearn simulate --models-module examples/my_algorithm.py --algorithm half-step --nodes 8 --lr 0.3 --iterations 30
    meshlearn simulate --models-module examples/my_algorithm.py --algorithm half-step --nodes 256 --engine batched \
        --lr 0.3 --iterations 30
"""

from meshlearn.definitions import Needs, RoundAlgorithm, register_algorithm


@register_algorithm
class HalfStep(RoundAlgorithm):
    """D-PSGD that moves only halfway toward the neighbours' average each round."""

    name = "half-step"
    summary = "halfway to the neighbours' Metropolis-Hastings average"
    needs = Needs(dynamic=True)  # TCP, full models, mean; static or changing peers

    def merge(self, own, state, mixed, iteration):
        own.lerp_(mixed, 0.5)  # own: [B, P]; mixed: the round's weighted average
