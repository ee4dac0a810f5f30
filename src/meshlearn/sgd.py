"""SGD on flat parameter rows: ``torch.optim.SGD``'s update, for one node's flat state (a
process-engine node) or every node's at once (the batched engine's [N, P] rows).

The nodes' own optimizer, in place of ``torch.optim.SGD``: the same arithmetic per element (a
test checks it), one kernel per update over the whole flat vector, and no ``torch.optim`` import,
which loads ``torch._dynamo`` on first use (about 70 MB in every node process)."""

from __future__ import annotations

import torch


class StackedSGD:
    """SGD with momentum and weight decay (no dampening, no Nesterov) on rows of parameters, each
    row with its own momentum buffer: row i follows exactly the update ``torch.optim.SGD`` makes
    for node i."""

    def __init__(self, params: torch.Tensor, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        self.params = params  # [N, P], a view the update writes through
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self.buffer: torch.Tensor | None = None  # momentum, from the first step on

    @torch.no_grad()
    def step(self, grads: torch.Tensor) -> None:
        """One update from every node's gradient ``grads`` [N, P] (which it may overwrite)."""
        if self.weight_decay:
            grads.add_(self.params, alpha=self.weight_decay)
        if self.momentum:
            if self.buffer is None:
                self.buffer = grads.clone()
            else:
                self.buffer.mul_(self.momentum).add_(grads)
            grads = self.buffer
        self.params.add_(grads, alpha=-self.lr)
