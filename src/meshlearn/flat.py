"""A model's parameters and floating-point buffers mirrored by one contiguous state vector."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

# Large states travel as segments of at most this many bytes: each becomes one ZeroMQ frame, and
# frames this size are served from reusable heap memory instead of a fresh mmap per message.
SEGMENT_BYTES = 8 * 1024 * 1024
SNAPSHOT_POOL = 4


class Receipt(Protocol):
    """What a transport returns for a send: whether it is done reading the sent buffers."""

    @property
    def done(self) -> bool: ...


@dataclass(frozen=True)
class Slot:
    """Where one named tensor lives inside the state vector."""

    name: str
    offset: int
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


class FlatState:
    """Rebinds a model's parameters and float buffers as views into one state vector.

    ``state`` holds the parameters first (``params`` is that slice), then the floating-point
    buffers such as BatchNorm running statistics (``buffers``). Sending a model is one frame per
    segment, averaging is arithmetic on whole vectors, and UDP chunks are byte ranges of it.
    Build it before the optimizer, which must see the new views. Buffers that are not floating
    point (BatchNorm's ``num_batches_tracked``) stay as they are: counters, not state to average.
    """

    def __init__(self, model: nn.Module):
        params = list(model.named_parameters())
        buffers = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        if not params:
            raise ValueError("model has no parameters")
        dtype, device = params[0][1].dtype, params[0][1].device
        named = params + buffers
        for name, tensor in named:
            if tensor.dtype != dtype:
                raise ValueError(f"{name} is {tensor.dtype}; all parameters and float buffers must share {dtype}")
        self.state = torch.empty(sum(t.numel() for _, t in named), dtype=dtype, device=device)
        self.slots: list[Slot] = []
        self._bound: list[tuple[str, Callable[[], torch.Tensor | None], int]] = []  # name, where it is now, where it must be
        offset = 0
        for index, (name, tensor) in enumerate(named):
            view = self.state[offset:offset + tensor.numel()].view_as(tensor)
            with torch.no_grad():
                view.copy_(tensor)
            if index < len(params):
                tensor.data = view
                self._bound.append((name, lambda p=tensor: p, view.data_ptr()))
            else:
                owner_name, _, attr = name.rpartition(".")
                owner = model.get_submodule(owner_name) if owner_name else model
                owner._buffers[attr] = view
                self._bound.append((name, lambda o=owner, a=attr: o._buffers.get(a), view.data_ptr()))
            self.slots.append(Slot(name, offset, tuple(tensor.shape)))
            offset += tensor.numel()
        n_params = sum(p.numel() for _, p in params)
        self.params = self.state[:n_params]
        self.buffers = self.state[n_params:]
        self.ranges = segment_ranges(self.state.numel(), self.state.element_size())
        self._segments = {name: self.state[a:b] for name, (a, b) in self.ranges.items()}
        self._pool: list[tuple[torch.Tensor, Receipt | None]] = []

    def unbound(self) -> str | None:
        """The name of the first parameter or buffer that no longer lives in ``state`` (the model was
        converted or moved after this was built: ``.double()``, ``.to()``, ``.cuda()``), else None."""
        for name, current, pointer in self._bound:
            tensor = current()
            if tensor is None or tensor.data_ptr() != pointer:
                return name
        return None

    @property
    def nbytes(self) -> int:
        """Bytes of state sent per model exchange."""
        return self.state.numel() * self.state.element_size()

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state as named segments (views, not copies), as sent on the wire."""
        return self._segments

    def snapshot(self, vector: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """A CPU copy of the state (or of ``vector``, of its size and dtype) as segments, safe to
        send while training goes on (the one copy).

        Copies go into pooled buffers; hand the transport's receipt to ``release`` so the buffer
        is reused once the transport is done with it (no page faults from fresh allocations).
        """
        for index, (buffer, receipt) in enumerate(self._pool):
            if receipt is not None and receipt.done:
                self._pool[index] = (buffer, None)
                break
        else:
            buffer = torch.empty(self.state.shape, dtype=self.state.dtype)
            if len(self._pool) < SNAPSHOT_POOL:
                self._pool.append((buffer, None))
        with torch.no_grad():
            buffer.copy_(self.state if vector is None else vector)
        return self.segments_of(buffer)

    def segments_of(self, vector: torch.Tensor) -> dict[str, torch.Tensor]:
        """A full state vector cut into the wire's named segments (views)."""
        return {name: vector[a:b] for name, (a, b) in self.ranges.items()}

    def release(self, snapshot: dict[str, torch.Tensor], receipt: Receipt) -> None:
        """Mark a snapshot reusable once ``receipt.done`` (snapshots not from the pool are ignored)."""
        first = next(iter(snapshot.values()), None)
        for index, (buffer, _) in enumerate(self._pool):
            if first is not None and first.data_ptr() == buffer.data_ptr():
                self._pool[index] = (buffer, receipt)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Overwrite the state with received segments of the same layout."""
        with torch.no_grad():
            for name, target in self._segments.items():
                target.copy_(tensors[name])

    def check_compatible(self, tensors: dict[str, torch.Tensor]) -> str | None:
        """Why received tensors cannot be averaged into this state, or None if they can."""
        if tensors.keys() != self._segments.keys():
            return f"tensors {sorted(tensors)[:3]}... do not match this model's segments"
        for name, mine in self._segments.items():
            theirs = tensors[name]
            if theirs.dtype != mine.dtype or theirs.shape != mine.shape:
                return f"tensor {name!r} is {theirs.dtype} {list(theirs.shape)}, expected {mine.dtype} {list(mine.shape)}"
        return None


def segment_ranges(numel: int, element_size: int) -> dict[str, tuple[int, int]]:
    """Name -> (start, stop) element range of each wire segment of a vector of ``numel`` elements,
    each at most SEGMENT_BYTES."""
    step = max(1, SEGMENT_BYTES // element_size)
    return {f"state.{i}": (start, min(start + step, numel)) for i, start in enumerate(range(0, numel, step))}
