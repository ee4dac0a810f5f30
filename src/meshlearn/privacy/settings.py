"""The ``dp`` setting: DP-SGD in each node's local training, written as a small language and
parsed once, where a configuration is read, into a ``DPSettings`` (no torch here).

    none                                      no differential privacy (the default)
    epsilon=8,delta=1e-5[,max_grad_norm=1]    the noise that spends epsilon over the run's steps
    noise_multiplier=1.1,max_grad_norm=1[,delta=1e-5]   this noise; the epsilon spent is reported

Each step clips every example's gradient to ``max_grad_norm`` and adds Gaussian noise of
``noise_multiplier * max_grad_norm`` to their sum (``privacy.dpsgd``); the accountant
(``privacy.accountant``) says the epsilon spent at ``delta``, per node (its shard is its data).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from meshlearn.errors import ConfigError
from meshlearn.settings import SpecSettings, parse_key_values

DP_HELP = ("differential privacy of each node's training (DP-SGD): none | epsilon=8,delta=1e-5[,max_grad_norm=1] "
           "(the noise that spends epsilon over the run) | noise_multiplier=1.1,max_grad_norm=1[,delta=1e-5]; "
           "noise and batches from secret randomness (,seeded=true: from the seed, for experiments); the epsilon "
           "spent is reported (docs/privacy.md)")
KEYS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "seeded")


class DPSettings(SpecSettings):
    """DP-SGD's budget or noise (see the module docstring)."""

    epsilon: float | None = Field(None, gt=0, description="the epsilon to spend over the run (sets the noise)")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of (epsilon, delta)-DP")
    noise_multiplier: float | None = Field(None, gt=0, description="the noise's standard deviation over the "
                                           "clipping norm")
    max_grad_norm: float = Field(1.0, gt=0, description="each example's gradient is clipped to this norm")
    seeded: bool = Field(False, description="draw the noise and the batches from the run's seed (reproducible, "
                         "and both engines alike, but no privacy against anyone who knows the seed: for "
                         "experiments); false: from the operating system's secret randomness")

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """``parse_dp``."""
        return parse_dp(text)

    @model_validator(mode="after")
    def _one_of_budget_or_noise(self) -> "DPSettings":
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ConfigError("dp: give epsilon (the noise follows) or noise_multiplier (the epsilon is reported), "
                              "not both")
        return self

    @property
    def active(self) -> bool:
        """Whether training is private."""
        return self.epsilon is not None or self.noise_multiplier is not None

    @property
    def spec(self) -> str:
        """The setting as written (``epsilon=8.0,delta=1e-05,max_grad_norm=1.0``)."""
        if not self.active:
            return "none"
        first = f"epsilon={self.epsilon!r}" if self.epsilon is not None else \
            f"noise_multiplier={self.noise_multiplier!r}"
        return f"{first},delta={self.delta!r},max_grad_norm={self.max_grad_norm!r}" + \
            (",seeded=true" if self.seeded else "")

    def noise_for(self, sample_rate: float, steps: int) -> float:
        """The noise multiplier of a node whose steps sample ``sample_rate`` of its shard, ``steps`` of them."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        from meshlearn.privacy.accountant import noise_multiplier_for

        return noise_multiplier_for(self.epsilon, self.delta, sample_rate, steps)


def parse_dp(text: str) -> dict[str, Any]:
    """``"epsilon=8,delta=1e-5"`` -> DPSettings' fields; ConfigError saying what is wrong."""
    return parse_keys("dp", text, KEYS, required=("epsilon", "noise_multiplier"))


CENTRAL_DP_HELP = ("central differential privacy of the leader's aggregate (DP-FedAvg, with sync): none | "
                   "noise_multiplier=1.0,clip=1.0[,delta=1e-5][,seeded=true]: each member clips its update over the "
                   "cycle to "
                   "norm clip, the leader adds Gaussian noise of noise_multiplier * clip / members to their mean; "
                   "the epsilon spent (per member) is reported (docs/privacy.md)")
CENTRAL_KEYS = ("noise_multiplier", "clip", "delta", "seeded")


class CentralDPSettings(SpecSettings):
    """DP-FedAvg's clipping and noise (McMahan et al. 2018, fixed clipping): see ``CENTRAL_DP_HELP``."""

    noise_multiplier: float | None = Field(None, gt=0, description="the noise over the clipping norm")
    clip: float = Field(1.0, gt=0, description="each member's update over a cycle is clipped to this norm")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of the (epsilon, delta) reported")
    seeded: bool = Field(False, description="the leader's noise from the run's seed (for experiments; no privacy "
                         "against anyone who knows it); false: from the operating system's secret randomness")

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """``noise_multiplier=1,clip=1[,delta=1e-5]`` -> the fields."""
        return parse_keys("central_dp", text, CENTRAL_KEYS, required=("noise_multiplier",))

    @property
    def active(self) -> bool:
        """Whether the aggregate is noised."""
        return self.noise_multiplier is not None

    @property
    def spec(self) -> str:
        """The setting as written."""
        if not self.active:
            return "none"
        return f"noise_multiplier={self.noise_multiplier!r},clip={self.clip!r},delta={self.delta!r}" + \
            (",seeded=true" if self.seeded else "")


def parse_keys(what: str, text: str, keys: tuple[str, ...], required: tuple[str, ...]) -> dict[str, Any]:
    """``"k=v,k=v"`` with numbers for ``keys`` (one of ``required`` given) -> a dict; ``{}`` for none."""
    text = str(text).strip()
    if text.lower() in ("", "none", "off"):
        return {}
    fields = parse_key_values(text, keys, what, text, lambda item: f"{item!r} is not KEY=VALUE with a key "
                              f"of {', '.join(keys)}", booleans=("seeded",))
    if not any(key in fields for key in required):
        raise ConfigError(f"give {' or '.join(k + '=...' for k in required)}", setting=what, value=text)
    return fields
