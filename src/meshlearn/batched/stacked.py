"""Every node's model in one tensor: row i of an [N, P] matrix is node i's flat state."""

from __future__ import annotations

import torch
from torch import nn

from meshlearn.checkpoint import Stateful
from meshlearn.flat import FlatState

CONSENSUS_BLOCK = 1 << 22  # parameter values taken to float64 at once for the consensus distance (32 MB)


class StackedState(Stateful):
    """The states of ``nodes`` copies of ``model``, one row each, in ``FlatState``'s layout
    (parameters first, then floating-point buffers such as BatchNorm's running statistics).

    A row is exactly what a process-engine node sends and averages, so algorithms work on whole
    rows (``state``) and training on the parameter columns (``params``). Buffers that are not
    floating point (BatchNorm's ``num_batches_tracked``) are counters, kept apart, one per node.
    Every node starts from ``model``'s current values (the run's one initial model).
    """

    state_fields = ("state", "counters")

    def __init__(self, model: nn.Module, nodes: int, device: torch.device | str = "cpu"):
        self.template = model
        flat = FlatState(model)  # rebinds the template to views of one vector; its values are the start
        self.slots = flat.slots
        self.nodes = nodes
        self.param_count = flat.params.numel()
        self.param_names = [name for name, _ in model.named_parameters()]
        self.buffer_slots = self.slots[len(self.param_names):]  # floating-point buffers (BatchNorm statistics)
        self.state = flat.state.detach().to(device).unsqueeze(0).repeat(nodes, 1).contiguous()
        self.counters = {name: buffer.detach().to(device).unsqueeze(0).repeat(nodes, *[1] * buffer.dim()).contiguous()
                         for name, buffer in model.named_buffers() if not buffer.is_floating_point()}

    @property
    def params(self) -> torch.Tensor:
        """The parameter columns, [N, param_count] (a view)."""
        return self.state[:, :self.param_count]

    @property
    def row_bytes(self) -> int:
        """Bytes of one node's state: what it sends per model exchange."""
        return self.state.shape[1] * self.state.element_size()

    def named(self, rows: torch.Tensor, counters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Views of a block of rows ([n, P], or one row [P]) shaped per parameter and buffer, with
        the block's counters: the mapping ``torch.func.functional_call`` takes."""
        lead = rows.shape[:-1]
        named = {slot.name: rows[..., slot.offset:slot.offset + slot.numel].view(*lead, *slot.shape)
                 for slot in self.slots}
        named.update(counters)
        return named

    def counters_of(self, index: torch.Tensor | int | slice | None) -> dict[str, torch.Tensor]:
        """The counters of some nodes (``index``: a tensor of ranks, one rank, a slice of ranks, or None for all)."""
        if index is None:
            return self.counters
        return {name: value[index] for name, value in self.counters.items()}

    def row(self, rank: int) -> torch.Tensor:
        """Node ``rank``'s state (a view)."""
        return self.state[rank]

    def consensus_sums(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """What the consensus distance needs of these nodes' rows (or of ``rows``, shaped like
        them), to be summed with other blocks' (float64): the row count, the sum of squared
        norms, then the sum of the parameter rows."""
        params = (self.state if rows is None else rows)[:, :self.param_count]
        sums = torch.zeros(2 + self.param_count, dtype=torch.float64, device=params.device)
        sums[0] = params.shape[0]
        for block in _double_blocks(params):
            sums[1] += block.pow(2).sum()
            sums[2:] += block.sum(0)
        return sums

    def state_sums(self, rows: torch.Tensor | None = None, leave_out: list[int] = ()) -> torch.Tensor:
        """What the nodes' average model needs of these nodes' rows (or of ``rows``, shaped like
        them) but those of ``leave_out``, to be summed with other blocks' (float64): the row
        count, then the sum of the rows (parameters and buffers)."""
        states = self.state if rows is None else rows
        sums = torch.zeros(1 + states.shape[1], dtype=torch.float64, device=states.device)
        sums[0] = states.shape[0] - len(leave_out)
        for block in _double_blocks(states):
            sums[1:] += block.sum(0)
        for row in leave_out:
            sums[1:] -= states[row].double()
        return sums


def _double_blocks(rows: torch.Tensor):
    """``rows`` in blocks of at most ``CONSENSUS_BLOCK`` values, each a float64 copy: sums over
    many rows without a float64 copy of them all."""
    for block in rows.split(max(1, CONSENSUS_BLOCK // max(1, rows.shape[1]))):
        yield block.double()


def average_row(sums: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The average state, one row [1, S] of ``dtype``, from every block's ``state_sums`` added up."""
    return (sums[1:] / sums[0].clamp(min=1)).to(dtype).unsqueeze(0)


def consensus_distance(sums: torch.Tensor) -> float:
    """sqrt(mean_i ||x_i - mean_j x_j||^2) over the parameters, from every block's
    ``consensus_sums`` added up: how far the nodes' models are apart."""
    count, squares, total = sums[0], sums[1], sums[2:]
    mean = total / count
    return float((squares / count - mean.pow(2).sum()).clamp(min=0).sqrt())
