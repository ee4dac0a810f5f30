"""Every node's forward and backward pass over the stacked state: vectorized over nodes with
``torch.func`` (``functional_call`` under ``vmap`` of ``grad``), or one node after another.

Each node's computation stays its own: its parameters, its buffers (BatchNorm's running
statistics are updated per node, in its row), its mini-batch. Both ways give each node what the
process engine computes for it, up to floating-point summation order.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.functional import cross_entropy

from meshlearn.batched.stacked import StackedState
from meshlearn.batched.workers import WorkerChoice, Workers
from meshlearn.privacy.dpsgd import PrivateGradients
from meshlearn.sgd import StackedSGD

LossOf = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (outputs, targets) -> the batch's mean loss
EVAL_SAMPLES_PER_CALL = 65_536  # node x sample (x position, for text) outputs per vectorized evaluation call


@dataclass
class Batch:
    """One mini-batch for each of some nodes, all of the same size: ``x`` [n, B, ...], ``y`` [n, B]."""

    ranks: torch.Tensor
    x: torch.Tensor
    y: torch.Tensor


def has_convolutions(model: nn.Module) -> bool:
    """Whether ``model`` convolves (vmap turns per-node convolutions into grouped ones, slower on a CPU)."""
    return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())


class _Replica:
    """One worker thread's copy of the template model, with the vectorized gradient bound to it
    (``functional_call`` rebinds a module's tensors while it runs, so threads may not share one)."""

    def __init__(self, model: nn.Module, loss_of: LossOf, clip: float | None = None):
        self.model = copy.deepcopy(model).train()
        self.loss_of = loss_of
        self.vgrad = vmap(grad_and_value(self.loss), randomness="different")
        self.private = None if clip is None else PrivateGradients(self.model, clip, loss_of)  # DP-SGD's

    def loss(self, params: dict, rest: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_of(functional_call(self.model, (params, rest), (x,)), y)


@dataclass
class _Job:
    """Nodes ``start:stop`` of ``batch``, whose gradients go to the step's rows ``at`` onwards."""

    batch: Batch
    start: int
    stop: int
    at: int


class NodeModels:
    """Gradients and predictions of every node's model, read from and written to ``stacked``.

    ``vectorized``: one ``vmap`` call per block of at most ``chunk`` nodes (0: all); else a loop
    over nodes. A training pass updates the nodes' buffers (BatchNorm statistics) in their rows.
    Training runs on worker threads of one intra-op thread each (``batched/workers.py``): as many
    as ``choice`` says, at most ``workers``; the count never changes a node's result. ``clip`` (DP-SGD):
    each node's gradient is the sum of its examples' gradients clipped to this norm
    (``privacy.dpsgd``), to which the engine adds the noise.
    """

    def __init__(self, stacked: StackedState, vectorized: bool, chunk: int = 0, workers: int = 1,
                 choice: WorkerChoice | None = None, clock: Callable[[], float] = time.perf_counter,
                 loss_of: LossOf | None = None, clip: float | None = None):
        self.stacked = stacked
        self.model = stacked.template
        self.vectorized = vectorized
        self.chunk = chunk or stacked.nodes
        self.loss_of = loss_of or cross_entropy  # the task's loss of (outputs, targets)
        self.clip = clip
        self.workers = Workers(workers, lambda: _Replica(self.model, self.loss_of, clip))
        self.choice = choice or WorkerChoice([1])
        self.clock = clock
        self.draws_random: bool | None = None  # whether a training step draws random numbers (known after the first)
        self._vforward = vmap(self._forward, randomness="different")
        self._param_slots = stacked.slots[:len(stacked.param_names)]
        self._grads: torch.Tensor | None = None  # [n, P], reused by every step
        self._losses: torch.Tensor | None = None
        self.update: StackedSGD | None = None  # plain SGD taken in the workers (``fuse``)

    def fuse(self, optimizer: object) -> bool:
        """Take ``optimizer``'s step in the workers, each block's right after its vmapped gradients,
        parameter by parameter: no gradient row is gathered into one buffer and read again. Only
        plain SGD (``StackedSGD.plain``) on the vectorized path; whether it was taken."""
        if self.vectorized and isinstance(optimizer, StackedSGD) and optimizer.plain and self.clip is None:
            self.update = optimizer
        return self.update is not None

    def _forward(self, named: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.model, named, (x,))

    def close(self) -> None:
        """Stop the worker threads."""
        self.workers.close()

    # --- training -----------------------------------------------------------------------------

    def gradients(self, batches: list[Batch]) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The loss gradients of the batches' nodes: their ranks [n] (batch after batch), the
        gradients [n, param_count] and the losses [n], in that order. The gradients are written into
        one buffer kept across steps (valid until the next call): a step allocates no [N, P] tensor.
        With the optimizer ``fuse``d, its step is taken instead, and the gradients are None."""
        stacked = self.stacked
        ranks = batches[0].ranks if len(batches) == 1 else torch.cat([batch.ranks for batch in batches])
        if self._grads is None or len(self._grads) < len(ranks):  # as many rows as the most nodes a step trains
            columns = 0 if self.update is not None else stacked.param_count  # fused: no gradient is kept
            self._grads = torch.empty((len(ranks), columns), dtype=stacked.state.dtype, device=stacked.state.device)
            self._losses = torch.empty(len(ranks), dtype=stacked.state.dtype, device=stacked.state.device)
        grads, losses = self._grads[:len(ranks)], self._losses[:len(ranks)]
        workers = self.choice.next()
        jobs = self._jobs(batches, workers)
        work = lambda replica, part: self._work(replica, part, grads, losses)  # noqa: E731
        if self.draws_random is None:
            # the first node alone, to learn whether a step draws random numbers (dropout): drawn from
            # threads at once, they would come in an order that changes from run to run
            before = torch.random.get_rng_state()
            self.workers.run(work, jobs[:1], 1)
            self.draws_random = not torch.equal(before, torch.random.get_rng_state())
            if self.draws_random:
                self.choice = WorkerChoice([1])
            self.workers.run(work, jobs[1:], self.choice.next())
        else:
            began = self.clock()
            self.workers.run(work, jobs, workers)
            self.choice.record(workers, self.clock() - began)
        return ranks, None if self.update is not None else grads, losses

    def _jobs(self, batches: list[Batch], workers: int) -> list[_Job]:
        """The step's jobs: one per node, or (vectorized) blocks of at most ``chunk`` nodes, as many
        as the workers at least."""
        jobs, at = [], 0
        for batch in batches:
            count = len(batch.ranks)
            size = min(self.chunk, -(-count // workers)) if self.vectorized else 1
            for start in range(0, count, size):
                stop = min(count, start + size)
                jobs.append(_Job(batch, start, stop, at))
                at += stop - start
        return jobs

    def _work(self, replica: _Replica, jobs: Iterable[_Job], grads: torch.Tensor, losses: torch.Tensor) -> None:
        for job in jobs:
            batch, count = job.batch, job.stop - job.start
            if self.vectorized:
                self._vectorized(replica, batch.ranks[job.start:job.stop], batch.x[job.start:job.stop],
                                 batch.y[job.start:job.stop], grads[job.at:job.at + count],
                                 losses[job.at:job.at + count])
            elif replica.private is not None:
                losses[job.at] = self._private_node(replica, int(batch.ranks[job.start]), batch.x[job.start],
                                                    batch.y[job.start], grads[job.at])
            else:
                losses[job.at] = self._node(replica.model, int(batch.ranks[job.start]), batch.x[job.start],
                                            batch.y[job.start], grads[job.at])

    def _node(self, model: nn.Module, rank: int, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Node ``rank``'s loss on (x, y); its gradient accumulated straight into ``grad`` [P]
        (each parameter a leaf viewing the node's row, whose ``.grad`` views ``grad``)."""
        named = self.stacked.named(self.stacked.row(rank), self.stacked.counters_of(rank))
        grad.zero_()
        for slot in self._param_slots:
            leaf = named[slot.name].detach().requires_grad_()
            leaf.grad = grad[slot.offset:slot.offset + slot.numel].view(slot.shape)
            named[slot.name] = leaf
        if x.dim() == 4 and x.device.type == "cpu":  # images channels-last: oneDNN's faster convolutions here
            x = x.contiguous(memory_format=torch.channels_last)
        loss = self.loss_of(functional_call(model, named, (x,)), y)
        loss.backward()
        return loss.detach()

    def _private_node(self, replica: _Replica, rank: int, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor
                      ) -> torch.Tensor:
        """DP-SGD: node ``rank``'s clipped per-example gradients' sum into ``grad`` [P]; its mean loss."""
        named = self.stacked.named(self.stacked.row(rank), self.stacked.counters_of(rank))
        params = {name: named[name] for name in self.stacked.param_names}
        sums, loss = replica.private.clipped_sum(params, {k: v for k, v in named.items() if k not in params}, x, y)
        torch.cat([sums[name].reshape(-1) for name in self.stacked.param_names], out=grad)
        return loss.detach()

    def _vectorized(self, replica: _Replica, ranks: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    grads: torch.Tensor, losses: torch.Tensor) -> None:
        """The gradients of the nodes ``ranks`` into ``grads`` [n, P] and their losses into
        ``losses`` [n], one vmap call; their BatchNorm statistics into their rows."""
        stacked = self.stacked
        first = int(ranks[0])
        consecutive = bool((ranks == torch.arange(first, first + len(ranks), device=ranks.device)).all())
        target = slice(first, first + len(ranks)) if consecutive else ranks  # a view of the rows, not a copy
        rows = stacked.state[target]
        counters = stacked.counters_of(target)
        named = stacked.named(rows, counters)
        # vmap writes BatchNorm's statistics only into contiguous tensors (a strided view of the rows
        # would silently keep the old values): update copies, then put them back into the rows.
        buffers = {slot.name: named[slot.name].contiguous() for slot in stacked.buffer_slots}
        named.update(buffers)
        params = {name: named[name] for name in stacked.param_names}
        vgrad = replica.vgrad if replica.private is None else replica.private.over_nodes  # DP-SGD: clipped sums
        grad, loss = vgrad(params, {name: v for name, v in named.items() if name not in params}, x, y)
        if self.update is None:
            torch.cat([grad[name].reshape(len(ranks), -1) for name in stacked.param_names], 1, out=grads)
        else:
            for slot in self._param_slots:
                self.update.step_part(target, slice(slot.offset, slot.offset + slot.numel),
                                      grad[slot.name].reshape(len(ranks), -1))
        losses.copy_(loss.detach())
        for slot in stacked.buffer_slots:
            stacked.state[target, slot.offset:slot.offset + slot.numel] = buffers[slot.name].reshape(len(ranks), -1)
        for name, value in counters.items():  # (a view of the rows' counters: the copy onto itself is harmless)
            stacked.counters[name][target] = value

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
        positions = x.shape[1] if x.dim() == 2 and not x.is_floating_point() else 1  # token windows: T outputs each
        per_call = max(1, min(self.chunk, EVAL_SAMPLES_PER_CALL // max(1, len(x) * positions)))
        out = []
        for start in range(0, len(ranks), per_call):
            index = torch.tensor(ranks[start:start + per_call], device=stacked.state.device)
            # every node gets its own (expanded, not copied) view of x: vmap's GroupNorm fails on an unbatched input
            shared = x.unsqueeze(0).expand(len(index), *x.shape)
            block = rows[start:start + per_call]
            out.append(self._vforward(stacked.named(block, stacked.counters_of(index)), shared))
        return torch.cat(out)
