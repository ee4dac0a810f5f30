"""QG-DSGDm, quasi-global momentum (Lin, Karimireddy, Stich and Jaggi 2021, "Quasi-global
momentum: accelerating decentralized deep learning on heterogeneous data", ICML): D-PSGD with
heavy-ball momentum whose buffer follows the network's progress, not the node's own gradients,
made for data that differs between nodes (label-skewed splits).

Each node keeps a quasi-global buffer ``m̂`` (zero at the start); with the run's momentum ``β``,
learning rate ``η`` and the buffer's own factor ``μ`` (``qgdsgdm_mu``; the paper's choice is β)::

    m = β m̂ + g(x_t)          x_{t+½} = x_t - η m          x_{t+1} = W x_{t+½}
    m̂ <- μ m̂ + (1 - μ) (x_t - x_{t+1}) / η

so the buffer is a moving average of how far the node actually moved, after averaging, which
already holds its neighbours' progress. The local step is the run's SGD step with its momentum
buffer set to ``m̂`` first (``StackedSGD.rows_state``), weight decay included; the payload is the
model, so any exchange D-PSGD's merge takes (a lossy transport's chunks, a robust rule) works here.

What it assumes: optimizer sgd with momentum (β > 0); one local step per iteration, as the paper's
rule is written."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from meshlearn.definitions.base import Exchange, RoundAlgorithm, State, one_step_refusal, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.settings import Settings

if TYPE_CHECKING:
    from torch import Tensor


class QuasiGlobalSettings(Settings):
    """QG-DSGDm's settings (flat name: ``qgdsgdm_mu``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"mu": "qgdsgdm_mu"}

    mu: float | None = Field(None, ge=0, lt=1, description="the quasi-global buffer's own factor μ in "
                             "m̂ <- μ m̂ + (1 - μ) d; none: the run's momentum, as the paper sets it")


@register_algorithm
class QuasiGlobalMomentum(RoundAlgorithm):
    """QG-DSGDm: each node's SGD momentum buffer is its quasi-global one, updated from its move after the average."""

    name = "qgdsgdm"
    settings = QuasiGlobalSettings
    needs = Needs(lossy=True, robust=True, byzantine=True, dynamic=True)
    summary = ("quasi-global momentum, Lin et al. 2021: D-PSGD whose momentum follows each node's move after "
               "averaging, for label-skewed data")

    @classmethod
    def conflict(cls, run) -> str | None:
        from meshlearn.optim import parse_optimizer

        if parse_optimizer(run.optimizer) != ("SGD", {}) or not run.momentum:
            return (f"algorithm {cls.name} replaces SGD's momentum buffer: use optimizer sgd with momentum (e.g. "
                    "momentum 0.9)")
        return one_step_refusal(cls.name, run)

    def local_optimizer(self, optimizer: Any, state: State) -> Any:
        """The run's SGD, kept (its buffer is set to ``buffer``, the quasi-global one, before each
        step); ``start``: the model each iteration starts from."""
        params = optimizer.params
        state["buffer"], state["start"] = params.new_zeros(params.shape), params.new_zeros(params.shape)
        self.optimizer = optimizer
        options = self.options or QuasiGlobalSettings()
        self.mu = optimizer.momentum if options.mu is None else options.mu
        return optimizer

    def start_round(self, own: Tensor, state: State, iteration: int) -> None:
        """The SGD step's momentum buffer is ``m̂``; the start of the iteration is kept."""
        self.optimizer.rows_state()["momentum_buffer"].copy_(state["buffer"])
        state["start"].copy_(own[:, :state["start"].shape[1]])

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The model is the average; ``m̂ <- μ m̂ + (1 - μ) (x_t - x_{t+1}) / η``."""
        own.copy_(mixed)
        if not self.optimizer.lr:  # a schedule's zero rate: no step was taken, the buffer stays
            return
        moved = state["start"].sub_(own[:, :state["start"].shape[1]])  # x_t - x_{t+1}, in place of x_t
        state["buffer"].mul_(self.mu).add_(moved, alpha=(1.0 - self.mu) / self.optimizer.lr)
