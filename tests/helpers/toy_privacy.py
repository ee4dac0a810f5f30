"""A toy privacy mechanism in one file with one registration (tests/test_privacy_registry.py): every
local step of every node adds one fixed perturbation, drawn once from the run's seed, to the node's
gradient, and the node's final event says how many steps it perturbed. It acts in the runs that ask
for it by name (``privacy: toy-perturbation``, ``--privacy toy-perturbation``), and refuses to go with
DP-SGD."""

import torch

from meshlearn.privacy.mechanism import PrivacyMechanism, register_privacy

SCALE = 0.05  # the perturbation's size, against gradients of about 0.1-1 per value


@register_privacy
class ToyPerturbation(PrivacyMechanism):
    """A seeded perturbation of each local step (see the module)."""

    name = "toy-perturbation"
    asked = ("privacy toy-perturbation", "privacy without it")

    @classmethod
    def conflicts(cls, config):
        return [(config.dp.active, "dp none (one perturbation of the steps at a time)")]

    def __init__(self, config, nodes):
        super().__init__(config, nodes)
        generator = torch.Generator().manual_seed(config.seed)
        self.perturbation = (SCALE * torch.randn(nodes.params, generator=generator)).to(nodes.device)
        self.steps = [0] * len(nodes.ranks)

    def local_step(self, rows, grads) -> None:
        grads += self.perturbation
        for row in rows:
            self.steps[row] += 1

    def report(self, row: int) -> dict:
        return {"toy_privacy": {"steps": self.steps[row]}}
