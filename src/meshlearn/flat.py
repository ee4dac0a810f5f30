"""A model's parameters and floating-point buffers mirrored by two contiguous flat tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn


# Large buffers travel as segments of at most this many bytes: each becomes one ZeroMQ frame, and
# frames this size are served from reusable heap memory instead of a fresh mmap per message.
SEGMENT_BYTES = 8 * 1024 * 1024
SNAPSHOT_POOL = 4


class Receipt(Protocol):
    """What a transport returns for a send: whether it is done reading the sent buffers."""

    @property
    def done(self) -> bool: ...


@dataclass(frozen=True)
class Slot:
    """Where one named tensor lives inside a flat buffer."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class FlatState:
    """Rebinds a model's parameters (and float buffers) as views into one flat tensor each.

    Sending a model is then one frame per buffer, averaging is arithmetic on whole buffers,
    and UDP chunks are slices. Build it before the optimizer, which must see the new views.
    Buffers that are not floating point (BatchNorm's ``num_batches_tracked``) stay as they are:
    they are counters, not state to average.
    """

    def __init__(self, model: nn.Module):
        params = [(n, p) for n, p in model.named_parameters()]
        buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        if not params:
            raise ValueError("model has no parameters")
        dtype = params[0][1].dtype
        self.params, self.param_slots = _flatten(model, params, dtype, is_param=True)
        self.buffers, self.buffer_slots = _flatten(model, buffers, dtype, is_param=False)
        self._segments = _segments(self.params, "params") | _segments(self.buffers, "buffers")
        self._pool: list[tuple[dict[str, torch.Tensor], Receipt | None]] = []

    @property
    def nbytes(self) -> int:
        """Bytes of state sent per model exchange."""
        return (self.params.numel() + self.buffers.numel()) * self.params.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state as named segments of the flat buffers (views, not copies), as sent on the wire."""
        return self._segments

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of the state, safe to send while training goes on: the one copy per send.

        Copies go into pooled buffers; hand the transport's receipt to ``release`` so the buffer
        is reused once the transport is done with it (no page faults from fresh allocations).
        """
        for index, (buffers, receipt) in enumerate(self._pool):
            if receipt is not None and receipt.done:
                self._pool[index] = (buffers, None)
                break
        else:
            buffers = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in self._segments.items()}
            if len(self._pool) < SNAPSHOT_POOL:
                self._pool.append((buffers, None))
        with torch.no_grad():
            for name, target in buffers.items():
                target.copy_(self._segments[name])
        return buffers

    def release(self, snapshot: dict[str, torch.Tensor], receipt: Receipt) -> None:
        """Mark a snapshot reusable once ``receipt.done`` (snapshots not from the pool are ignored)."""
        for index, (buffers, _) in enumerate(self._pool):
            if buffers is snapshot:
                self._pool[index] = (buffers, receipt)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the state with received flat buffers of the same layout."""
        with torch.no_grad():
            for name, target in self.tensors().items():
                target.copy_(tensors[name])

    def check_compatible(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why received tensors cannot be averaged into this state, or None if they can."""
        for name, mine in self.tensors().items():
            theirs = tensors.get(name)
            if theirs is None:
                return f"missing tensor {name!r}"
            if theirs.dtype != mine.dtype or theirs.shape != mine.shape:
                return f"tensor {name!r} is {theirs.dtype} {list(theirs.shape)}, expected {mine.dtype} {list(mine.shape)}"
        return None


def _segments(flat: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """Name -> contiguous slice of ``flat``, each at most SEGMENT_BYTES."""
    step = max(1, SEGMENT_BYTES // flat.element_size())
    return {f"{prefix}.{i}": flat[start:start + step] for i, start in enumerate(range(0, flat.numel(), step))}


def _flatten(model: nn.Module, named: list[tuple[str, torch.Tensor]], dtype: torch.dtype, is_param: bool):
    device = named[0][1].device if named else next(model.parameters()).device
    total = sum(t.numel() for _, t in named)
    flat = torch.empty(total, dtype=dtype, device=device)
    slots = []
    offset = 0
    for name, tensor in named:
        if tensor.dtype != dtype:
            raise ValueError(f"{name} is {tensor.dtype}; all parameters and float buffers must share {dtype}")
        n = tensor.numel()
        view = flat[offset:offset + n].view_as(tensor)
        with torch.no_grad():
            view.copy_(tensor)
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if is_param:
            tensor.data = view
        else:
            owner._buffers[attr] = view
        slots.append(Slot(name, offset, tuple(tensor.shape)))
        offset += n
    return flat, slots
