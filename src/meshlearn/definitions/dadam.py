"""Adam with mixed moments: D-PSGD whose nodes average their optimizer's moments with their
neighbours as they average their models, so each node's adaptive step is normalised by an estimate
of the network's moments, not its own batch's alone. In the spirit of DADAM (Nazari, Tarzanagh and
Michailidis 2019, "DADAM: A consensus-based distributed adaptive gradient method for online
optimization", arXiv:1901.09109), which mixes the models of nodes taking Adam-like steps, and of
Chen, Karimi, Zhao and Li ("On the convergence of decentralized adaptive gradient methods",
arXiv:2109.03194), whose analysis needs the nodes' adaptive rates brought to consensus; neither
paper's rule exactly.

What it does: a node takes its local steps with the run's optimizer (Adam or AdamW: torch's
arithmetic, bias correction included), then sends its model and every per-parameter state tensor
of its optimizer (Adam's first and second moments, AMSGrad's maximum too): ``[x, m, v]``, three
times a model. The merge takes the weighted average of each: ``x, m, v <- W [x, m, v]`` (adapt,
then combine). An average of honest second moments stays positive.

What it assumes: an optimizer that keeps state per parameter (adam, adamw, adamax, nadam, radam,
rmsprop, ...; or SGD with momentum, whose buffer is then mixed); every message whole (TCP; a lost
chunk of a moment would bias it); the weighted average (no robust rule); honest nodes (a forged
second moment can be negative, and its average gives every neighbour NaN). The step count, shared
by every node, is not sent."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshlearn.definitions.base import Exchange, RoundAlgorithm, State, register_algorithm
from meshlearn.definitions.needs import Needs

if TYPE_CHECKING:
    from torch import Tensor


@register_algorithm
class MixedMomentsAdam(RoundAlgorithm):
    """Average ``[x, m, v]`` (the model and the optimizer's moments) with the neighbours after the local steps."""

    name = "dadam"
    needs = Needs(dynamic=True, why_not=(
        ("lossy", "a lost chunk of a moment would leave the moments of another model"),
        ("robust", "a robust rule over moments is no average of them"),
        ("byzantine", "a forged second moment can be negative, and its average gives every neighbour NaN")))
    summary = ("Adam with its moments mixed over the graph like the models (after DADAM, Nazari et al. 2019): each "
               "node's step normalised by the network's moments")

    @classmethod
    def conflict(cls, run) -> str | None:
        from meshlearn.optim import parse_optimizer

        name, args = parse_optimizer(run.optimizer)
        if name == "SGD" and not (run.momentum or args.get("momentum")):
            return (f"algorithm {cls.name} mixes the optimizer's moments, and optimizer {run.optimizer} keeps none: "
                    "use optimizer adamw (or adam)")
        return None

    def local_optimizer(self, optimizer: Any, state: State) -> Any:
        """The run's optimizer, kept: its moments (``rows_state``) are sent and merged."""
        self.optimizer = optimizer
        return optimizer

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """``[x, *moments]``: [B, S + k P] for the optimizer's k per-parameter state tensors."""
        parts = (own, *self.optimizer.rows_state().values())
        sent = own.new_empty((own.shape[0], sum(part.shape[1] for part in parts)))
        for into, part in zip(_split(sent, parts), parts):
            into.copy_(part)
        return sent

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The model and each moment become their weighted averages."""
        parts = (own, *self.optimizer.rows_state().values())
        for part, average in zip(parts, _split(mixed, parts)):
            part.copy_(average)


def _split(payload: Tensor, parts: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``payload`` [B, S + k P] as views, one of each of ``parts``' widths."""
    return payload.split([part.shape[1] for part in parts], 1)
