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

from pydantic import Field, model_serializer, model_validator

from meshlearn.errors import ConfigError
from meshlearn.settings import Settings

DP_HELP = ("differential privacy of each node's training (DP-SGD): none | epsilon=8,delta=1e-5[,max_grad_norm=1] "
           "(the noise that spends epsilon over the run) | noise_multiplier=1.1,max_grad_norm=1[,delta=1e-5]; "
           "the epsilon spent is reported (docs/privacy.md)")
KEYS = ("epsilon", "delta", "noise_multiplier", "max_grad_norm")


class DPSettings(Settings):
    """DP-SGD's budget or noise (see the module docstring)."""

    epsilon: float | None = Field(None, gt=0, description="the epsilon to spend over the run (sets the noise)")
    delta: float = Field(1e-5, gt=0, lt=1, description="delta of (epsilon, delta)-DP")
    noise_multiplier: float | None = Field(None, gt=0, description="the noise's standard deviation over the "
                                           "clipping norm")
    max_grad_norm: float = Field(1.0, gt=0, description="each example's gradient is clipped to this norm")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if value is None:
            return {}
        if isinstance(value, str):
            return parse_dp(value)
        return value

    @model_validator(mode="after")
    def _one_of_budget_or_noise(self) -> "DPSettings":
        if self.epsilon is not None and self.noise_multiplier is not None:
            raise ConfigError("dp: give epsilon (the noise follows) or noise_multiplier (the epsilon is reported), "
                              "not both")
        return self

    @model_serializer
    def _as_string(self) -> str:
        return self.spec

    @property
    def active(self) -> bool:
        """Whether training is private."""
        return self.epsilon is not None or self.noise_multiplier is not None

    @property
    def spec(self) -> str:
        """The setting as written (``epsilon=8.0,delta=1e-05,max_grad_norm=1.0``)."""
        if not self.active:
            return "none"
        first = f"epsilon={self.epsilon!r}" if self.epsilon is not None else f"noise_multiplier={self.noise_multiplier!r}"
        return f"{first},delta={self.delta!r},max_grad_norm={self.max_grad_norm!r}"

    def noise_for(self, sample_rate: float, steps: int) -> float:
        """The noise multiplier of a node whose steps sample ``sample_rate`` of its shard, ``steps`` of them."""
        if self.noise_multiplier is not None:
            return self.noise_multiplier
        from meshlearn.privacy.accountant import noise_multiplier_for

        return noise_multiplier_for(self.epsilon, self.delta, sample_rate, steps)


def parse_dp(text: str) -> dict[str, Any]:
    """``"epsilon=8,delta=1e-5"`` -> DPSettings' fields; ConfigError saying what is wrong."""
    text = str(text).strip()
    if text.lower() in ("", "none", "off"):
        return {}
    fields: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (p.strip() for p in item.partition("="))
        if not sep or key not in KEYS:
            raise ConfigError(f"dp {text!r}: {item!r} is not KEY=VALUE with a key of {', '.join(KEYS)} (e.g. "
                              "epsilon=8,delta=1e-5)")
        try:
            fields[key] = float(value)
        except ValueError:
            raise ConfigError(f"dp {text!r}: {key} must be a number") from None
    if "epsilon" not in fields and "noise_multiplier" not in fields:
        raise ConfigError(f"dp {text!r}: give epsilon=E (a budget) or noise_multiplier=S (a noise)")
    return fields
