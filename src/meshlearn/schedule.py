"""Learning-rate schedules (the ``lr_schedule`` setting): the factor of ``lr`` each iteration's
local steps use, the same in both engines (every node reads it from the iteration it is at).

Written ``constant``, ``cosine`` or either with options: ``cosine:warmup=20,min=0.1`` warms up
linearly over the first 20 iterations, then decays along a cosine to 0.1 x lr at the last one (the
schedule language models are trained with, as AdamW's companion); ``constant:warmup=20`` warms up,
then holds ``lr``. Parsed once, where a configuration is read, into an ``LrSchedule``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, model_serializer, model_validator

from meshlearn.errors import ConfigError
from meshlearn.settings import Settings
from meshlearn.suggest import did_you_mean

SCHEDULES = ("constant", "cosine")  # the kinds of schedule
SCHEDULE_HELP = ("constant | cosine (decays to MIN x lr at the last iteration along a cosine), either with "
                 ":warmup=N (a linear warm-up over the first N iterations) and cosine with min=MIN (0.1 if left out): "
                 "e.g. cosine:warmup=20,min=0.1")


class LrSchedule(Settings):
    """The factor of ``lr`` at each iteration (see the module docstring)."""

    kind: Literal["constant", "cosine"] = Field("constant", description="constant | cosine")
    warmup: int = Field(0, ge=0, description="iterations of linear warm-up from lr / warmup to lr")
    min: float = Field(0.1, ge=0, le=1, description="cosine: the factor of lr at the last iteration")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if value is None:
            return {}
        return parse_schedule(value) if isinstance(value, str) else value

    @model_serializer
    def _as_string(self) -> str:
        options = [f"warmup={self.warmup}"] * bool(self.warmup) + [f"min={self.min:g}"] * (self.kind == "cosine")
        return self.kind + (":" + ",".join(options) if options else "")

    @property
    def constant(self) -> bool:
        """Whether every iteration uses ``lr`` itself."""
        return self.kind == "constant" and not self.warmup

    def factor(self, iteration: int, iterations: int) -> float:
        """The factor of ``lr`` at ``iteration`` (0-based) of a run of ``iterations``."""
        if iteration < self.warmup:
            return (iteration + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = (iteration - self.warmup) / max(1, iterations - self.warmup - 1)
        return self.min + (1.0 - self.min) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def parse_schedule(text: str) -> dict[str, Any]:
    """``"cosine:warmup=20"`` -> the fields of an LrSchedule; ConfigError saying what is wrong."""
    kind, _, rest = str(text).strip().partition(":")
    kind = kind.strip().lower()
    if kind not in SCHEDULES:
        raise ConfigError(f"{did_you_mean(kind, SCHEDULES)}write constant or cosine, optionally with :warmup=N "
                          "(and min=F for cosine)", setting="lr_schedule", value=text)
    fields: dict[str, Any] = {"kind": kind}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = (p.strip() for p in item.partition("="))
        if not sep or key not in ("warmup", "min") or (key == "min" and kind != "cosine"):
            raise ConfigError(f"{item!r} is not warmup=N" + (" or min=F" if kind == "cosine" else ""),
                              setting="lr_schedule", value=text)
        try:
            fields[key] = int(value) if key == "warmup" else float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a " + ("whole number" if key == "warmup" else "number"),
                              setting="lr_schedule", value=text) from None
    return fields
