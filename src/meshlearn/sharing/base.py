"""The sharing interface: what a node sends of its model, and what a receiver reads back.

A scheme is built once per node for its state's size (``make_sharing``). ``encode`` turns the
model to send into the message's tensors; ``decode`` validates a neighbour's tensors and returns
``Shared``: the values it sent over the whole state and, for a partial model, where it sent them.
Receivers average partial models per value over the neighbours that sent it (D-PSGD's
``missing_chunks`` rule, as for chunks lost on UDP). A scheme that ``mixes`` (CHOCO-SGD) replaces
that average with its own update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from meshlearn.sharing.spec import SHARINGS, parse_sharing


@dataclass
class Shared:
    """A neighbour's model as received: ``values`` over the whole state (zeros where nothing was
    sent) and ``mask`` (True where a value was sent; None when all were)."""

    values: torch.Tensor
    mask: torch.Tensor | None = None


class Sharing(ABC):
    """One node's side of a sharing scheme (``numel`` values of ``dtype`` per model; ``seed``: the
    run's, for schemes that draw)."""

    name: ClassVar[str]
    mixes: ClassVar[bool] = False  # True: the scheme updates the model itself (``mix_``)

    def __init__(self, numel: int, dtype: torch.dtype, seed: int):
        self.numel, self.dtype, self.seed = numel, dtype, seed

    def start(self, state: torch.Tensor) -> None:
        """Called once with the node's initial model, before its first ``encode``."""

    @abstractmethod
    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        """The message's tensors for ``vector``, the model node ``sender`` sends at ``iteration``
        (new CPU tensors: the transport may read them while the model trains on)."""

    @abstractmethod
    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        """What ``sender`` sent at ``iteration``; ValueError saying what is wrong with ``tensors``
        (sizes, types, positions, non-finite values)."""

    def averaged(self, state: torch.Tensor) -> None:
        """Called with the node's model after each average."""

    def wire_bytes(self) -> int:
        """Bytes of tensors one message carries (the batched engine's traffic count)."""
        return sum(t.nbytes for t in self.encode(torch.zeros(self.numel, dtype=self.dtype), 0, 0).values())

    def __str__(self) -> str:
        return self.name


def register_sharing(cls: type[Sharing]) -> type[Sharing]:
    """Class decorator adding a scheme to the registry under ``cls.name``."""
    return SHARINGS.add(cls.name, cls)


def make_sharing(text: str, numel: int, dtype: torch.dtype, seed: int) -> Sharing:
    """The scheme ``text`` names (``topk:0.1``) for a model of ``numel`` values."""
    spec = parse_sharing(text)
    return SHARINGS.get(spec.name)(numel, dtype, seed, *spec.args)


def share_count(alpha: float, numel: int) -> int:
    """How many of ``numel`` values (or nodes) an ``alpha`` share is (at least one): ``alpha *
    numel`` rounded up, after rounding away float noise (0.07 * 100 is 7.000000000000001: 7, not 8)."""
    return max(1, min(numel, math.ceil(round(alpha * numel, 9))))


def sends_indices(count: int, numel: int) -> bool:
    """Whether ``count`` positions of ``numel`` travel as int32 indices (else as a bitmap of
    ``numel`` bits): whichever is smaller. Sender, receiver and byte count all ask this."""
    return count * 4 <= -(-numel // 8)


def sparse_bytes(count: int, numel: int, element_size: int) -> int:
    """Bytes ``encode_sparse`` sends for ``count`` of ``numel`` values."""
    return count * element_size + (count * 4 if sends_indices(count, numel) else -(-numel // 8))


def seeded_generator(*keys: int) -> torch.Generator:
    """A CPU generator seeded from integers (run seed, sender, iteration, ...): the same draws in
    both engines and on every receiver."""
    state = np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 31 ^ int(state[1]))


def expect(tensors: dict[str, torch.Tensor], shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """ValueError unless ``tensors`` are exactly the named tensors of those dtypes and shapes."""
    if tensors.keys() != shapes.keys():
        raise ValueError(f"expected tensors {sorted(shapes)}, got {sorted(tensors)[:4]}")
    for name, (dtype, shape) in shapes.items():
        tensor = tensors[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}")


def finite(values: torch.Tensor, what: str = "values") -> torch.Tensor:
    """``values``, or ValueError if any is NaN or infinite."""
    if not bool(torch.isfinite(values).all()):
        raise ValueError(f"{what} hold NaN or Inf")
    return values


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes below ``2**bits`` (any integer or bool dtype), ``8 // bits`` to a byte, low bits first."""
    values = codes.numpy().astype(np.uint8, copy=False)
    if bits == 8:
        return torch.from_numpy(values.copy())
    if bits == 1:
        return torch.from_numpy(np.packbits(values, bitorder="little"))
    per_byte = 8 // bits
    padded = np.pad(values, (0, -len(values) % per_byte)).reshape(-1, per_byte)
    packed = padded[:, 0].copy()
    for slot in range(1, per_byte):
        packed |= padded[:, slot] << (slot * bits)
    return torch.from_numpy(packed)


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of ``pack_bits`` (uint8)."""
    values = packed.numpy()
    if bits == 8:
        return torch.from_numpy(values[:count].copy())
    if bits == 1:
        return torch.from_numpy(np.unpackbits(values, count=count, bitorder="little"))
    shifts = np.arange(8 // bits, dtype=np.uint8) * bits
    return torch.from_numpy(((values[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count].astype(np.uint8))


def largest(values: torch.Tensor, count: int) -> torch.Tensor:
    """The sorted positions of the ``count`` largest of ``values`` (a CPU vector)."""
    array = values.float().numpy() if values.dtype == torch.bfloat16 else values.numpy()  # numpy has no bfloat16
    if count >= len(array):
        return torch.arange(len(array))
    return torch.from_numpy(np.sort(np.argpartition(array, len(array) - count)[len(array) - count:]))


def encode_sparse(vector: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """The values of ``vector`` at sorted ``positions``, and the positions: as int32 indices or as
    a bitmap of the whole state, whichever is smaller."""
    out = {"values": vector[positions].contiguous()}
    if sends_indices(positions.numel(), vector.numel()):
        out["indices"] = positions.to(torch.int32)
    else:
        bitmap = torch.zeros(vector.numel(), dtype=torch.bool)
        bitmap[positions] = True
        out["bitmap"] = pack_bits(bitmap, 1)
    return out


def decode_sparse(tensors: dict[str, torch.Tensor], numel: int, dtype: torch.dtype, count: int) -> Shared:
    """``encode_sparse``'s tensors, checked to hold ``count`` finite values at distinct positions
    inside the state; ValueError otherwise."""
    bitmap = -(-numel // 8)
    if sends_indices(count, numel):
        expect(tensors, {"values": (dtype, (count,)), "indices": (torch.int32, (count,))})
        positions = tensors["indices"].to(torch.int64)
        if count and (int(positions[0]) < 0 or int(positions[-1]) >= numel or
                      (count > 1 and not bool((positions[1:] > positions[:-1]).all()))):
            raise ValueError(f"indices must rise strictly inside 0 .. {numel - 1}")
        mask = torch.zeros(numel, dtype=torch.bool)
        mask[positions] = True
    else:
        expect(tensors, {"values": (dtype, (count,)), "bitmap": (torch.uint8, (bitmap,))})
        bits = unpack_bits(tensors["bitmap"], 1, bitmap * 8).bool()
        if bool(bits[numel:].any()):
            raise ValueError("the bitmap marks positions past the end of the model")
        mask = bits[:numel]
        if int(mask.sum()) != count:
            raise ValueError(f"the bitmap marks {int(mask.sum())} positions for {count} values")
    values = torch.zeros(numel, dtype=dtype)
    values[mask] = finite(tensors["values"])
    return Shared(values, mask)
