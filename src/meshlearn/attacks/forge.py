"""The behaviours: what a bad node sends, computed from its own (honestly trained) model."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from meshlearn.attacks.spec import ByzantineSpec


@dataclass
class ForgeInputs:
    """What a bad node has when it sends: its first model, the models its neighbours sent this
    round (``[D, P]``, for attacks that need them: ``rushing``), and a seeded generator."""

    initial: torch.Tensor
    neighbours: torch.Tensor | None = None
    generator: torch.Generator | None = None


class Attack(ABC):
    """A bad node's behaviour. ``forge`` gives the flat model it sends in place of ``own``;
    ``rushing`` attacks wait for their neighbours' models of the round first (the strongest
    adversary a synchronous protocol allows); ``flips_labels`` ones train on labels ``C-1-y``."""

    name: ClassVar[str]
    rushing: ClassVar[bool] = False
    flips_labels: ClassVar[bool] = False

    def __init__(self, arg: float | None = None):
        self.arg = arg

    @abstractmethod
    def forge(self, own: torch.Tensor, inputs: ForgeInputs) -> torch.Tensor:
        """The model sent instead of ``own`` (a new tensor; ``own`` is not modified)."""

    def sent(self, own: torch.Tensor, initial: torch.Tensor, seed: int, rank: int, iteration: int,
             neighbours: torch.Tensor | None = None) -> torch.Tensor:
        """What node ``rank`` sends at ``iteration`` of a run seeded ``seed``: ``forge`` with its
        first model, the neighbours' models it saw, and the generator both engines draw from."""
        return self.forge(own, ForgeInputs(initial, neighbours, attack_generator(seed, rank, iteration)))


class SignFlip(Attack):
    name = "sign-flip"

    def forge(self, own, inputs):
        return own * -self.arg


class Scale(Attack):
    name = "scale"

    def forge(self, own, inputs):
        return own * self.arg


class Gaussian(Attack):
    """Random noise of standard deviation ``arg`` in place of a model (Xie et al. 2018)."""

    name = "gaussian"

    def forge(self, own, inputs):
        noise = torch.randn(own.shape, generator=inputs.generator, dtype=own.dtype)
        return noise.to(own.device) * self.arg


class LabelFlip(Attack):
    """Trains on flipped labels and sends that model as it is."""

    name = "label-flip"
    flips_labels = True

    @staticmethod
    def flip(labels: torch.Tensor, classes: int) -> torch.Tensor:
        """The labels a label-flipping node trains on: ``C - 1 - y``."""
        return classes - 1 - labels

    def forge(self, own, inputs):
        return own.clone()


class Stale(Attack):
    """Keeps sending its first model."""

    name = "stale"

    def forge(self, own, inputs):
        return inputs.initial.to(own.device, own.dtype).clone()


class ALittleIsEnough(Attack):
    """"A little is enough" (Baruch et al. 2019): per coordinate, the mean of the honest models it
    sees minus ``Z`` of their standard deviation: close enough to pass robust rules, and every
    round pulling the same way."""

    name = "alie"
    rushing = True

    def forge(self, own, inputs):
        seen = own.unsqueeze(0) if inputs.neighbours is None or not len(inputs.neighbours) else \
            torch.cat([own.unsqueeze(0), inputs.neighbours.to(own.device, own.dtype)])
        return seen.mean(0) - self.arg * seen.std(0, unbiased=False)


ATTACKS: dict[str, type[Attack]] = {cls.name: cls for cls in (SignFlip, Scale, Gaussian, LabelFlip, Stale,
                                                               ALittleIsEnough)}


def make_attack(spec: ByzantineSpec) -> Attack:
    """The behaviour ``spec`` names."""
    return ATTACKS[spec.behaviour](spec.arg)


def attack_generator(seed: int, rank: int, iteration: int) -> torch.Generator:
    """The generator of node ``rank``'s random attack at ``iteration`` (the same in both engines)."""
    state = np.random.SeedSequence([seed, rank, iteration, 0xBAD]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state) & ((1 << 63) - 1))
