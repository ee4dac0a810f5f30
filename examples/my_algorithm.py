"""A user's algorithm in one file: D-PSGD that moves only part of the way toward the neighbours'
average, how far its own setting says (``--half-step-pull``, or ``half_step_pull:`` in a file).

    meshlearn simulate --models-module examples/my_algorithm.py --algorithm half-step --half-step-pull 0.5 \
        --nodes 8 --lr 0.3 --iterations 30
    meshlearn simulate --models-module examples/my_algorithm.py --algorithm half-step --half-step-pull 0.5 \
        --nodes 256 --engine batched --lr 0.3 --iterations 30
"""

from typing import ClassVar

from pydantic import Field

from meshlearn.definitions import Needs, RoundAlgorithm, register_algorithm
from meshlearn.settings import Settings


class HalfStepSettings(Settings):
    """half-step's one setting (its flag: ``--half-step-pull``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"pull": "half_step_pull"}

    pull: float = Field(0.5, gt=0, le=1, description="half-step: how far toward the neighbours' average each round")


@register_algorithm
class HalfStep(RoundAlgorithm):
    """D-PSGD that moves only part of the way (``pull``) toward the neighbours' average each round."""

    name = "half-step"
    summary = "part of the way to the neighbours' Metropolis-Hastings average"
    needs = Needs(dynamic=True)  # TCP, full models, mean; static or changing peers
    settings = HalfStepSettings  # the engines build it with these settings: self.options

    def merge(self, own, state, mixed, exchange):
        own.lerp_(mixed, self.options.pull)  # own: [B, P]; mixed: the exchange's weighted average
