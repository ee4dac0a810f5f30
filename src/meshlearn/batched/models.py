"""Every node's forward and backward pass over the stacked state: vectorized over nodes with
``torch.func`` (``functional_call`` under ``vmap`` of ``grad``), or one node after another.

Each node's computation stays its own: its parameters, its buffers (BatchNorm's running
statistics are updated per node, in its row), its mini-batch. Both ways give each node what the
process engine computes for it, up to floating-point summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap

from meshlearn.batched.stacked import StackedState

EVAL_SAMPLES_PER_CALL = 65_536  # node x sample pairs per vectorized evaluation call (bounds memory)


@dataclass
class Batch:
    """One mini-batch for each of some nodes, all of the same size: ``x`` [n, B, ...], ``y`` [n, B]."""

    ranks: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor


def has_convolutions(model: nn.Module) -> bool:
    """Whether ``model`` convolves (vmap turns per-node convolutions into grouped ones, slower on a CPU)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


class NodeModels:
    """Gradients and predictions of every node's model, read from and written to ``stacked``.

    ``vectorized``: one ``vmap`` call per block of at most ``chunk`` nodes (0: all); else a loop
    over nodes. A training pass updates the nodes' buffers (BatchNorm statistics) in their rows.
    """

    def __init__(self, stacked: StackedState, vectorized: bool, chunk: int = 0):
        self.stacked = stacked
        self.model = stacked.template
        self.vectorized = vectorized
        self.chunk = chunk or stacked.nodes
        self._grad = grad_and_value(self._loss)
        self._vgrad = vmap(self._grad, randomness="different")
        self._vforward = vmap(self._forward, randomness="different")
        self._grads: torch.Tensor | None = None  # [n, P], reused by every step
        self._losses: torch.Tensor | None = None

    # --- the per-node functions -----------------------------------------------------------------

    def _split(self, named: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        params = {name: named[name] for name in self.stacked.param_names}
        return params, {name: value for name, value in named.items() if name not in params}

    def _loss(self, params: dict, rest: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(functional_call(self.model, (params, rest), (x,)), y)

    def _forward(self, named: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, named, (x,))

    # --- training -----------------------------------------------------------------------------

    def gradients(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The loss gradients of the batches' nodes: their ranks [n] (batch after batch), the
        gradients [n, param_count] and the losses [n], in that order. The gradients are written into
        one buffer kept across steps (valid until the next call): a step allocates no [N, P] tensor."""
        stacked = self.stacked
        ranks = batches[0].ranks if len(batches) == 1 else torch.cat([batch.ranks for batch in batches])
        if self._grads is None or len(self._grads) < len(ranks):  # as many rows as the most nodes a step trains
            self._grads = torch.empty((len(ranks), stacked.param_count), dtype=stacked.state.dtype,
                                      device=stacked.state.device)
            self._losses = torch.empty(len(ranks), dtype=stacked.state.dtype, device=stacked.state.device)
        grads, losses = self._grads[:len(ranks)], self._losses[:len(ranks)]
        self.model.train()
        at = 0
        for batch in batches:
            if self.vectorized:
                for start in range(0, len(batch.ranks), self.chunk):
                    part = slice(start, start + self.chunk)
                    count = len(batch.ranks[part])
                    self._vectorized(batch.ranks[part], batch.x[part], batch.y[part], grads[at:at + count],
                                     losses[at:at + count])
                    at += count
            else:
                for index, rank in enumerate(batch.ranks.tolist()):
                    named = stacked.named(stacked.row(rank), stacked.counters_of(rank))
                    grad, loss = self._grad(*self._split(named), batch.x[index], batch.y[index])
                    self._flatten(grad, grads[at:at + 1])
                    losses[at] = loss
                    at += 1
        return ranks, grads, losses

    def _vectorized(self, ranks: torch.Tensor, x: torch.Tensor, y: torch.Tensor, grads: torch.Tensor,
                    losses: torch.Tensor) -> None:
        """The gradients of the nodes ``ranks`` into ``grads`` [n, P] and their losses into
        ``losses`` [n], one vmap call; their BatchNorm statistics into their rows."""
        stacked = self.stacked
        whole = len(ranks) == stacked.nodes and bool((ranks == torch.arange(stacked.nodes, device=ranks.device)).all())
        rows = stacked.state if whole else stacked.state[ranks]
        counters = stacked.counters_of(None if whole else ranks)
        named = stacked.named(rows, counters)
        # vmap writes BatchNorm's statistics only into contiguous tensors (a strided view of the rows
        # would silently keep the old values): update copies, then put them back into the rows.
        buffers = {slot.name: named[slot.name].contiguous() for slot in stacked.buffer_slots}
        named.update(buffers)
        grad, loss = self._vgrad(*self._split(named), x, y)
        self._flatten(grad, grads)
        losses.copy_(loss.detach())
        target = slice(None) if whole else ranks
        for slot in stacked.buffer_slots:
            stacked.state[target, slot.offset:slot.offset + slot.numel] = buffers[slot.name].reshape(len(ranks), -1)
        if not whole:
            for name, value in counters.items():
                stacked.counters[name][ranks] = value

    def _flatten(self, grad: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """Per-parameter gradients of n nodes into ``out`` [n, P], in the state's parameter order."""
        torch.cat([grad[name].reshape(len(out), -1) for name in self.stacked.param_names], 1, out=out)

    # --- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def logits(self, ranks: list[int], x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The models of ``ranks`` on inputs ``x`` [b, ...] (evaluation mode): [len(ranks), b,
        classes]. ``rows``: their states to use (one per rank) instead of the current ones."""
        stacked = self.stacked
        self.model.eval()
        if rows is None:
            rows = stacked.state[torch.tensor(ranks, device=stacked.state.device)]
        if not self.vectorized:
            return torch.stack([self._forward(stacked.named(rows[k], stacked.counters_of(r)), x)
                                for k, r in enumerate(ranks)])
        per_call = max(1, min(self.chunk, EVAL_SAMPLES_PER_CALL // max(1, len(x))))
        out = []
        for start in range(0, len(ranks), per_call):
            index = torch.tensor(ranks[start:start + per_call], device=stacked.state.device)
            # every node gets its own (expanded, not copied) view of x: vmap's GroupNorm fails on an unbatched input
            shared = x.unsqueeze(0).expand(len(index), *x.shape)
            block = rows[start:start + per_call]
            out.append(self._vforward(stacked.named(block, stacked.counters_of(index)), shared))
        return torch.cat(out)
