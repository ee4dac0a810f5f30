"""The nodes' optimizer, chosen by name: meshlearn's ``StackedSGD`` for ``sgd`` (no
``torch.optim`` import: about 70 MB less per node process), or any elementwise ``torch.optim``
optimizer (Adam, AdamW, RMSprop, ...) with its arguments, on flat parameter rows.

A spec is ``NAME`` or ``NAME:KEY=VALUE,...``; a value is a number, ``true``/``false``, or numbers
separated by spaces (a tuple): ``adam:betas=0.9 0.99,eps=1e-7``. ``lr``, ``momentum`` and
``weight_decay`` come from the run's own settings (momentum and weight decay only when set).
Only elementwise optimizers are offered: on the batched engine's ``[N, P]`` rows, each row then
follows exactly the update the optimizer makes for one node alone.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from meshlearn.checkpoint import Stateful
from meshlearn.errors import ConfigError
from meshlearn.suggest import did_you_mean

if TYPE_CHECKING:
    import torch

# name -> torch.optim class name; every one updates each element from its own gradient history
OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW", "adamax": "Adamax", "nadam": "NAdam",
              "radam": "RAdam", "rmsprop": "RMSprop", "adagrad": "Adagrad", "adadelta": "Adadelta", "rprop": "Rprop",
              "asgd": "ASGD"}
OPTIMIZER_HELP = ("sgd | adam | adamw | adamax | nadam | radam | rmsprop | adagrad | adadelta | rprop | "
                  "asgd, optionally with torch.optim arguments: NAME:KEY=VALUE,... (e.g. adam:betas=0.9 0.99,eps=1e-7)")
_KEY = re.compile(r"[a-z_][a-z0-9_]*")


def parse_optimizer(text: str) -> tuple[str, dict[str, Any]]:
    """``"adam:eps=1e-7"`` -> ("Adam", {"eps": 1e-07}); ConfigError saying what is wrong."""
    name, _, rest = str(text).strip().partition(":")
    cls = OPTIMIZERS.get(name.strip().lower())
    if cls is None:
        raise ConfigError(f"unknown optimizer {name!r}: {did_you_mean(name.strip(), list(OPTIMIZERS))}use one of "
                          f"{', '.join(OPTIMIZERS)}")
    args: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, sep, value = (p.strip() for p in item.partition("="))
        if key in ("lr", "params"):
            raise ConfigError(f"{key} comes from the run's own setting (lr), not from here", setting="optimizer",
                              value=text)
        if not sep or not _KEY.fullmatch(key):
            raise ConfigError(f"{item!r} is not KEY=VALUE", setting="optimizer", value=text)
        args[key] = _value(value, text)
    return cls, args


def _value(text: str, spec: str) -> Any:
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        numbers = [float(part) for part in text.split()]
    except ValueError:
        raise ConfigError(f"{text!r} is not a number, true/false, or numbers", setting="optimizer",
                          value=spec) from None
    if not numbers:
        raise ConfigError("a value is missing", setting="optimizer", value=spec)
    numbers = [int(n) if n.is_integer() and "." not in text and "e" not in text.lower() else n for n in numbers]
    return numbers[0] if len(numbers) == 1 else tuple(numbers)


class TorchRows(Stateful):
    """A ``torch.optim`` optimizer over parameter rows (``[N, P]``, a view the update writes
    through), stepped with explicit gradients like ``StackedSGD``; every row steps together."""

    state_fields = ("optimizer",)

    def __init__(self, params: "torch.Tensor", optimizer: "torch.optim.Optimizer"):
        self.params, self.optimizer = params, optimizer

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (a schedule's)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, grads: "torch.Tensor", rows: "torch.Tensor | None" = None) -> None:
        """One update of every row from ``grads``."""
        if rows is not None:
            raise ConfigError("this optimizer steps every node together: use optimizer sgd with asynchronous "
                              "algorithms on the batched engine")
        self.params.grad = grads
        self.optimizer.step()
        self.params.grad = None

    def rows_state(self) -> dict[str, "torch.Tensor"]:
        """The optimizer's state with a value per parameter (Adam's moments, RMSprop's averages), by
        torch's names, each [N, P] and live: writing one changes the next step. Empty before the
        first step (torch makes its state then)."""
        state = self.optimizer.state.get(self.params, {})
        return {name: value for name, value in state.items()
                if hasattr(value, "shape") and value.shape == self.params.shape}


class GradientInbox(Stateful):
    """What the local steps call in place of the run's ``optimizer`` where an algorithm takes the
    step itself, along a direction of its own (gradient tracking's): ``step(grads)`` keeps the
    gradients in ``gradient`` ([N, P], the algorithm's) and moves no parameter; ``set_lr`` goes on
    to the optimizer, which the algorithm steps. A checkpoint keeps that optimizer."""

    state_fields = ("optimizer",)

    def __init__(self, optimizer: Any, gradient: "torch.Tensor"):
        self.optimizer, self.gradient = optimizer, gradient
        self.params = optimizer.params

    def set_lr(self, lr: float) -> None:
        """The learning rate of the optimizer's next steps (a schedule's)."""
        self.optimizer.set_lr(lr)

    def step(self, grads: "torch.Tensor", rows: "torch.Tensor | None" = None) -> None:
        """Keep ``grads`` (every row's) for the algorithm; nothing moves."""
        if rows is not None:
            raise ConfigError("this algorithm takes every node's gradients together: every node trains every iteration")
        self.gradient.copy_(grads)


class ScaledGradients(Stateful):
    """What the local steps call in place of ``optimizer`` where each row's gradients count by a
    weight of its own (``weights`` [N]: an ``objective`` of samples): ``step`` scales them, in
    place, and steps ``optimizer``; every other use goes to it. A checkpoint keeps ``optimizer``."""

    state_fields = ("optimizer",)

    def __init__(self, optimizer: Any, weights: "torch.Tensor"):
        self.optimizer, self.weights = optimizer, weights[:, None]

    def __getattr__(self, name: str) -> Any:
        if name == "optimizer":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.optimizer, name)

    def set_lr(self, lr: float) -> None:
        """The learning rate of the optimizer's next steps (a schedule's)."""
        self.optimizer.set_lr(lr)

    def step(self, grads: "torch.Tensor", rows: "torch.Tensor | None" = None) -> None:
        """Scale ``grads`` (every row's, or those of ``rows``, in that order) by their weights, then step."""
        grads.mul_(self.weights if rows is None else self.weights[rows])
        self.optimizer.step(grads, rows)


def steps_rows_apart(spec: str) -> bool:
    """Whether the optimizer ``spec`` names steps each node's parameter rows on its own in the batched
    engine (plain SGD: ``StackedSGD``), so a node may skip a round's local steps (an algorithm's
    ``trains``) in both engines alike; a ``torch.optim`` one steps every row together, so with it
    every node trains every round, in both engines, and the engines still compute the same models."""
    return parse_optimizer(spec) == ("SGD", {})


def make_optimizer(spec: str, params: "torch.Tensor", lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """The optimizer ``spec`` names over parameter rows ``params`` (``[N, P]``)."""
    from meshlearn.sgd import StackedSGD

    name, args = parse_optimizer(spec)
    if name == "SGD" and not args:
        return StackedSGD(params, lr, momentum, weight_decay)
    import torch.optim

    settings = {"lr": lr, **({"momentum": momentum} if momentum else {}),
                **({"weight_decay": weight_decay} if weight_decay else {}), **args}
    try:
        return TorchRows(params, getattr(torch.optim, name)([params], **settings))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"torch.optim.{name} says: {exc}", setting="optimizer", value=spec) from None


def optimizer_of(run: Any, params: "torch.Tensor"):
    """The optimizer a run's settings ``run`` name (``optimizer``, ``lr``, ``momentum``,
    ``weight_decay``) over parameter rows ``params`` (``make_optimizer``): what both engines build."""
    return make_optimizer(run.optimizer, params, run.lr, run.momentum, run.weight_decay)
