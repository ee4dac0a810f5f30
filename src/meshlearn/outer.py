"""Outer optimizers (the ``outer`` setting): what a node does with an aggregate besides taking it.

Local training with an outer optimizer treats the aggregate as a step proposal: the
pseudo-gradient is the model before the round minus the aggregate, and an optimizer over rounds
moves the model along it. DiLoCo (Douillard et al. 2023) takes H AdamW steps locally, then an outer
SGD step with Nesterov momentum (lr 0.7, momentum 0.9); Reddi et al. 2021 ("Adaptive Federated
Optimization") give FedAvgM (SGD with momentum), FedAdam and FedYogi. ``none`` (the default) takes
the aggregate itself, exactly as without this setting.

Written ``none``, ``sgd:lr=1,momentum=0.9,nesterov=true``, ``nesterov:lr=0.7,momentum=0.9``
(SGD with Nesterov momentum), ``adam:lr=0.01,beta1=0.9,beta2=0.99,eps=0.001`` or ``yogi:...`` (the
same options). Parsed once, where a configuration is read, into an ``OuterOptimizer``; its
``step`` is a pure function of tensors (rows of models, each with its own state), which every
algorithm and both engines call.

Adam and Yogi follow Reddi et al.: no bias correction, ``eps`` (their tau) 1e-3 by default, Yogi's
second moment ``v - (1 - beta2) g^2 sign(v - g^2)``; both start their second moment at eps^2, as
the paper's experiments do. With ``lr`` 1 and no momentum, SGD is ``none`` (up to rounding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from meshlearn.errors import ConfigError
from meshlearn.settings import SpecSettings, parse_key_values
from meshlearn.suggest import did_you_mean

if TYPE_CHECKING:
    from torch import Tensor

OUTER_HELP = ("what a node does with an aggregate: none (takes it) | sgd:lr=L,momentum=M,nesterov=true|false | "
              "nesterov:lr=0.7,momentum=0.9 (DiLoCo's) | adam:lr=L,beta1=B1,beta2=B2,eps=E (FedAdam) | yogi:... "
              "(FedYogi); on the pseudo-gradient, the model before the round minus the aggregate")
KINDS = ("none", "sgd", "nesterov", "adam", "yogi")
DEFAULTS: dict[str, dict[str, Any]] = {  # each kind's defaults (the papers')
    "none": {}, "sgd": {"lr": 1.0, "momentum": 0.0, "nesterov": False},
    "nesterov": {"lr": 0.7, "momentum": 0.9, "nesterov": True},
    "adam": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3},
    "yogi": {"lr": 0.01, "beta1": 0.9, "beta2": 0.99, "eps": 1e-3}}
OutState = dict[str, "Tensor"]


class OuterOptimizer(SpecSettings):
    """An outer optimizer and its hyperparameters (see the module docstring)."""

    kind: Literal["none", "sgd", "nesterov", "adam", "yogi"] = Field("none", description="none | sgd | nesterov | "
                                                                                         "adam | yogi")
    lr: float = Field(1.0, gt=0, description="the outer learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="sgd, nesterov: momentum")
    nesterov: bool = Field(False, description="sgd: Nesterov's momentum")
    beta1: float = Field(0.9, ge=0, lt=1, description="adam, yogi: the first moment's decay")
    beta2: float = Field(0.99, ge=0, lt=1, description="adam, yogi: the second moment's decay")
    eps: float = Field(1e-3, gt=0, description="adam, yogi: added to the second moment's root (Reddi et al.'s tau)")

    @classmethod
    def parse(cls, text: str) -> dict[str, Any]:
        """``parse_outer``."""
        return parse_outer(text)

    @classmethod
    def from_mapping(cls, value: dict) -> dict:
        """A YAML map: its kind's defaults, and only its kind's keys."""
        kind = str(value.get("kind", "none")).strip().lower()
        if kind not in KINDS:
            raise ConfigError(f"outer kind {kind!r}: use one of {', '.join(KINDS)}")
        extra = sorted(set(value) - set(DEFAULTS[kind]) - {"kind"})
        if extra:
            raise ConfigError(f"outer {kind}: {', '.join(extra)} is not one of its options ("
                              f"{', '.join(DEFAULTS[kind]) or 'none'})")
        return {**DEFAULTS[kind], **value, "kind": kind}

    @property
    def spec(self) -> str:
        """The setting as written (``nesterov:lr=0.7,momentum=0.9``), its numbers exact."""
        if self.kind == "none":
            return "none"
        keys = [key for key in DEFAULTS[self.kind] if not (self.kind == "nesterov" and key == "nesterov")]
        values = [f"{key}={str(getattr(self, key)).lower() if key == 'nesterov' else repr(getattr(self, key))}"
                  for key in keys]
        return f"{self.kind}:{','.join(values)}"

    @property
    def copies(self) -> int:
        """Model-sized tensors its state holds per node: the model before the round, the
        pseudo-gradient's buffer, momentum or moments, and Adam's and Yogi's second buffer."""
        if not self.active:
            return 0
        return 2 + (3 if self.kind in ("adam", "yogi") else 1 if self.momentum > 0 else 0)

    @property
    def active(self) -> bool:
        """Whether the aggregate is not simply taken."""
        return self.kind != "none"

    def begin(self, rows: "Tensor") -> OutState:
        """The state of the nodes in ``rows`` [B, P] (their models): zero moments, ``before`` a copy
        of the models (what the next round's pseudo-gradient starts from), and the buffers a step
        works in (a step allocates nothing)."""
        state: OutState = {"before": rows.clone()}
        if not self.active:
            return state
        state["grad"] = rows.new_empty(rows.shape)
        if self.kind in ("sgd", "nesterov") and self.momentum > 0:
            state["momentum"] = rows.new_zeros(rows.shape)
        if self.kind in ("adam", "yogi"):
            state["m"] = rows.new_zeros(rows.shape)
            state["v"] = rows.new_full(rows.shape, self.eps ** 2)
            state["scratch"] = rows.new_empty(rows.shape)
        return state

    def step(self, aggregate: "Tensor", state: OutState, span: "tuple[int, int] | None" = None) -> None:
        """In place: the outer step from ``state["before"]`` along the pseudo-gradient ``before -
        aggregate``; ``aggregate`` [B, P] becomes the new models and ``state["before"]`` a copy of
        them (the next round's start). With ``none``, only that copy. ``span`` [a, b): only those
        values were aggregated (a part of the state, Streaming DiLoCo's fragment; the part past
        ``aggregate``'s P values, the model's buffers, has no outer step); the others are left alone."""
        if span is not None:
            a, b = max(0, span[0]), min(span[1], aggregate.shape[1])
            if a >= b:
                return
            aggregate, state = aggregate[:, a:b], {name: rows[:, a:b] for name, rows in state.items()}
        before = state["before"]
        if self.kind == "none":
            before.copy_(aggregate)
            return
        import torch

        grad = torch.sub(before, aggregate, out=state["grad"])  # the pseudo-gradient
        if self.kind in ("sgd", "nesterov"):
            if "momentum" in state:
                buffer = state["momentum"].mul_(self.momentum).add_(grad)
                grad = grad.add_(buffer, alpha=self.momentum) if self.nesterov or self.kind == "nesterov" else buffer
            aggregate.copy_(before).sub_(grad, alpha=self.lr)
        else:
            m, v, scratch = state["m"], state["v"], state["scratch"]
            m.mul_(self.beta1).add_(grad, alpha=1 - self.beta1)
            square = grad.mul_(grad)
            if self.kind == "adam":
                v.mul_(self.beta2).add_(square, alpha=1 - self.beta2)
            else:  # yogi: v - (1 - beta2) g^2 sign(v - g^2)
                v.sub_(torch.sub(v, square, out=scratch).sign_().mul_(square), alpha=1 - self.beta2)
            aggregate.copy_(before).addcdiv_(m, torch.sqrt(v, out=scratch).add_(self.eps), value=-self.lr)
        before.copy_(aggregate)


def parse_outer(text: str) -> dict[str, Any]:
    """``"nesterov:lr=0.7,momentum=0.9"`` -> the fields of an OuterOptimizer (each kind's defaults
    filled in); ConfigError saying what is wrong."""
    kind, _, rest = str(text).strip().partition(":")
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise ConfigError(f"{did_you_mean(kind, KINDS)}write one of {', '.join(KINDS)}, optionally with "
                          ":KEY=VALUE,... (e.g. nesterov:lr=0.7,momentum=0.9)", setting="outer", value=text)
    keys = [key for key in DEFAULTS[kind] if not (kind == "nesterov" and key == "nesterov")]
    options = parse_key_values(rest, keys, "outer", text, lambda item: f"{item!r} is not one of {kind}'s options "
                               f"(KEY=VALUE; keys: {', '.join(keys) or 'none'})", booleans=("nesterov",))
    return {"kind": kind, **DEFAULTS[kind], **options}
