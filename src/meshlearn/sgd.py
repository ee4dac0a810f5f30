"""SGD on flat parameter rows: ``torch.optim.SGD``'s update, for one node's flat state (a
process-engine node) or every node's at once (the batched engine's [N, P] rows).

The nodes' own optimizer, in place of ``torch.optim.SGD``: the same arithmetic per element (a
test checks it), one kernel per update over the whole flat vector, and no ``torch.optim`` import,
which loads ``torch._dynamo`` on first use (about 70 MB in every node process)."""

from __future__ import annotations

from typing import Callable

import torch

from meshlearn.checkpoint import Stateful


class StackedSGD(Stateful):
    """SGD with momentum and weight decay (no dampening, no Nesterov) on rows of parameters, each
    row with its own momentum buffer: row i follows exactly the update ``torch.optim.SGD`` makes
    for node i."""

    state_fields = ("lr", "buffer", "started")

    def __init__(self, params: torch.Tensor, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = params  # [N, P], a view the update writes through
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffer: torch.Tensor | None = None  # momentum, from each row's first step on
        self.started: torch.Tensor | None = None  # the rows that have taken a step

    def set_lr(self, lr: float) -> None:
        """The learning rate of the next steps (a schedule's)."""
        self.lr = lr

    @torch.no_grad()
    def step(self, grads: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """One update from the gradients ``grads`` (which it may overwrite): of every row, or of
        the rows ``rows`` only (``grads`` then holds theirs, in that order)."""
        if rows is not None and not self.weight_decay and not self.momentum:  # plain SGD: added in place
            self.params.index_add_(0, rows, grads, alpha=-self.lr)
            return
        params = self.params if rows is None else self.params[rows]
        if self.weight_decay:
            grads.add_(params, alpha=self.weight_decay)
        if self.momentum:
            if self.buffer is None:
                self.buffer = torch.zeros_like(self.params)
                self.started = torch.zeros(self.params.shape[0], dtype=torch.bool, device=self.params.device)
            buffer = self.buffer if rows is None else self.buffer[rows]
            started = self.started if rows is None else self.started[rows]
            if bool(started.all()):
                buffer.mul_(self.momentum).add_(grads)
            else:  # a row's first step: its buffer is the gradient, as torch's is
                buffer = torch.where(started[:, None], buffer.mul(self.momentum).add_(grads), grads)
            if rows is None:
                self.buffer.copy_(buffer)
                self.started.fill_(True)
            else:
                self.buffer[rows] = buffer
                self.started[rows] = True
            grads = buffer
        params.add_(grads, alpha=-self.lr)
        if rows is not None:
            self.params[rows] = params

    def rows_state(self) -> dict[str, torch.Tensor]:
        """The momentum buffer ([N, P], live: writing it changes the next step), made now where no
        step has made it yet (zero, which the next step turns into the gradient, as torch's first
        step does); empty without momentum."""
        if not self.momentum:
            return {}
        if self.buffer is None:
            self.buffer = torch.zeros_like(self.params)
            self.started = torch.ones(self.params.shape[0], dtype=torch.bool, device=self.params.device)
        return {"momentum_buffer": self.buffer}

    @property
    def plain(self) -> bool:
        """Whether the update is the gradient times the learning rate alone (no momentum, no weight decay)."""
        return not self.momentum and not self.weight_decay

    @torch.no_grad()
    def step_part(self, rows: slice | torch.Tensor, columns: slice, grads: torch.Tensor) -> None:
        """Plain SGD's update (``plain``) of the ``columns`` of some ``rows`` (a slice, or ranks in
        the order of ``grads``) from their gradients ``grads`` [rows, columns]: a share of ``step``'s
        update, the same arithmetic, taken where the gradients are made."""
        part = self.params[:, columns]
        if isinstance(rows, slice):
            part[rows].add_(grads, alpha=-self.lr)
        else:
            part.index_add_(0, rows, grads, alpha=-self.lr)


def local_gradient(model: torch.nn.Module, parameters: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                   loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient [1, P] of ``model``'s loss on the batch (``x``, ``y``: ``loss_of(outputs,
    targets)``, the task's; cross-entropy by default) with respect to ``parameters`` (the model's,
    in the order of the flat vector an optimizer updates as one row), and the loss."""
    model.train()
    outputs = model(x)
    loss = loss_of(outputs, y) if loss_of is not None else torch.nn.functional.cross_entropy(outputs, y)
    grads = torch.autograd.grad(loss, parameters, allow_unused=True, materialize_grads=True)
    return torch.cat([g.reshape(1, -1) for g in grads], 1), loss


def local_step(model: torch.nn.Module, parameters: list[torch.Tensor], optimizer: StackedSGD, x: torch.Tensor,
               y: torch.Tensor, loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """One SGD step of ``model`` on the batch: ``local_gradient``, then ``optimizer``'s update.
    Returns the loss (a process-engine node's step)."""
    grads, loss = local_gradient(model, parameters, x, y, loss_of)
    optimizer.step(grads)
    return loss
