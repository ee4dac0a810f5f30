"""The sharing interface: what a node sends of its model, and what a receiver reads back.

A scheme is built once per node for its state's size (``make_sharing``). ``encode`` turns the
model to send into the message's tensors; ``decode`` validates a neighbour's tensors and returns
``Shared``: the values it sent over the whole state and, for a partial model, where it sent them.
Receivers average partial models per value over the neighbours that sent it (D-PSGD's
``missing_chunks`` rule, as for chunks lost on UDP). A scheme that ``mixes`` (CHOCO-SGD) replaces
that average with its own update.

Over UDP a message travels in chunks laid out by the scheme's ``layout``, and some may be lost.
``receive`` then hands ``decode_partial`` which elements of each tensor arrived, and each scheme
keeps what its rule can still place (docs/sharing.md):

- ``subsample``: the values that arrived, at their seeded positions;
- ``topk``, ``choco``: built ``lossy`` (for UDP), they send each position beside its value, so a
  lost chunk loses whole pairs (a bitmap's lost byte would leave every later value without a
  place); what may have been sent in the lost pairs is ``unsure``;
- ``quantize``: the buckets (scales and codes) that arrived whole.

A scheme of a user's (``register_sharing``) that does not say loses a message whole when any
chunk is lost.
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from meshlearn.checkpoint import Stateful
from meshlearn.layout import TensorLayout
from meshlearn.sharing.spec import SHARINGS, parse_sharing


@dataclass
class Shared:
    """A neighbour's model as received: ``values`` over the whole state (zeros where nothing was
    sent or it was lost) and ``mask`` (True where a value arrived; None when all did). ``unsure``:
    where chunks were lost, the positions that may have been sent but were not read (for schemes
    whose receivers follow the sender's state, CHOCO-SGD); None when none."""

    values: torch.Tensor
    mask: torch.Tensor | None = None
    unsure: torch.Tensor | None = None


class Sharing(Stateful, ABC):
    """One node's side of a sharing scheme (``numel`` values of ``dtype`` per model; ``seed``: the
    run's, for schemes that draw). ``lossy``: its messages travel over a transport that may lose
    chunks of them (UDP), for schemes whose encoding should then differ; ``make_sharing`` sets it
    after the constructor, so read it in ``encode``, ``decode`` and ``layout``, not there.
    ``state_fields``: what a checkpoint keeps of a scheme that follows its messages (``checkpoint``)."""

    name: ClassVar[str]
    mixes: ClassVar[bool] = False  # True: the scheme updates the model itself (``mix_``)
    lossy: bool = False

    def __init__(self, numel: int, dtype: torch.dtype, seed: int):
        self.numel, self.dtype, self.seed = numel, dtype, seed
        self._layout: TensorLayout | None = None

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

    def decode_partial(self, tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], sender: int,
                       iteration: int) -> Shared | None:
        """What arrived of a message some of whose chunks were lost (``present``: per tensor, True
        for the elements that arrived; the others read as zeros), by the scheme's rule; None when
        nothing of it can be used. ValueError as ``decode``, for what arrived. By default nothing:
        a scheme that cannot use part of a message loses it whole."""
        return None

    def receive(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int,
                chunks: tuple[torch.Tensor, int] | None = None) -> Shared | None:
        """What ``sender``'s message of ``iteration`` holds: ``decode`` where it came whole, else
        ``decode_partial`` of what the chunks that arrived held (``chunks``: which of the message's
        chunks arrived, and their size in bytes). Both engines read neighbours' messages here."""
        if chunks is None or bool(chunks[0].all()):
            return self.decode(tensors, sender, iteration)
        return self.decode_partial(tensors, self.layout().presence(*chunks), sender, iteration)

    def averaged(self, state: torch.Tensor) -> None:
        """Called with the node's model after each average."""

    def layout(self) -> TensorLayout:
        """Where each of a message's tensors lies in its bytes, for transports that cut messages
        into chunks (UDP): one layout for every message, so a scheme whose tensors change shape
        from message to message cannot travel over UDP. By default that of a zero model encoded
        by a copy of the scheme (so its own state is left alone), worked out once."""
        if getattr(self, "_layout", None) is None:
            self._layout = TensorLayout.of(copy.deepcopy(self).encode(torch.zeros(self.numel, dtype=self.dtype), 0, 0))
        return self._layout

    def wire_bytes(self) -> int:
        """Bytes of tensors one message carries (the batched engine's traffic count)."""
        return self.layout().nbytes

    def __str__(self) -> str:
        return self.name


class SparseSharing(Sharing):
    """A scheme that sends ``count`` of the values with their positions (``encode_sparse``): over
    TCP as indices or a bitmap, over UDP (``lossy``) as (position, value) pairs."""

    count: int

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        return decode_sparse(tensors, self.numel, self.dtype, self.count, self.lossy)

    def decode_partial(self, tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], sender: int,
                       iteration: int) -> Shared | None:
        if not self.lossy:  # indices or a bitmap: a lost chunk leaves values without a place
            return None
        return decode_pairs(tensors, present, self.numel, self.dtype, self.count)

    def layout(self) -> TensorLayout:
        if getattr(self, "_layout", None) is None:
            self._layout = sparse_layout(self.count, self.numel, self.dtype, self.lossy)
        return self._layout


def register_sharing(cls: type[Sharing]) -> type[Sharing]:
    """Class decorator adding a scheme to the registry under ``cls.name``."""
    return SHARINGS.add(cls.name, cls)


def make_sharing(text: str, numel: int, dtype: torch.dtype, seed: int, lossy: bool = False) -> Sharing:
    """The scheme ``text`` names (``topk:0.1``) for a model of ``numel`` values (``lossy``: whose
    messages travel over UDP: sender, receivers and the batched engine must all say the same)."""
    spec = parse_sharing(text)
    scheme = SHARINGS.get(spec.name)(numel, dtype, seed, *spec.args)
    scheme.lossy = lossy
    return scheme


def share_count(alpha: float, numel: int) -> int:
    """How many of ``numel`` values (or nodes) an ``alpha`` share is (at least one): ``alpha *
    numel`` rounded up, after rounding away float noise (0.07 * 100 is 7.000000000000001: 7, not 8)."""
    return max(1, min(numel, math.ceil(round(alpha * numel, 9))))


def sends_indices(count: int, numel: int) -> bool:
    """Whether ``count`` positions of ``numel`` travel as int32 indices (else as a bitmap of
    ``numel`` bits): whichever is smaller. Sender, receiver and byte count all ask this."""
    return count * 4 <= -(-numel // 8)


def sparse_layout(count: int, numel: int, dtype: torch.dtype, lossy: bool) -> TensorLayout:
    """The layout of ``encode_sparse``'s tensors for ``count`` of ``numel`` values of ``dtype``."""
    return TensorLayout.of(encode_sparse(torch.zeros(numel, dtype=dtype), torch.arange(count), lossy))


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


def encode_sparse(vector: torch.Tensor, positions: torch.Tensor, lossy: bool = False) -> dict[str, torch.Tensor]:
    """The values of ``vector`` at sorted ``positions``, and the positions: as int32 indices or as
    a bitmap of the whole state, whichever is smaller; ``lossy``, as ``pairs`` (each position,
    int32, then its value, in bytes), so a lost chunk of the message loses whole pairs."""
    values = vector[positions].contiguous()
    if lossy:
        rows = [positions.to(torch.int32).view(torch.uint8).view(-1, 4), values.view(torch.uint8).view(len(values), -1)]
        return {"pairs": torch.cat(rows, 1).view(-1)}
    out = {"values": values}
    if sends_indices(positions.numel(), vector.numel()):
        out["indices"] = positions.to(torch.int32)
    else:
        bitmap = torch.zeros(vector.numel(), dtype=torch.bool)
        bitmap[positions] = True
        out["bitmap"] = pack_bits(bitmap, 1)
    return out


def decode_sparse(tensors: dict[str, torch.Tensor], numel: int, dtype: torch.dtype, count: int,
                  lossy: bool = False) -> Shared:
    """``encode_sparse``'s tensors, checked to hold ``count`` finite values at distinct positions
    inside the state; ValueError otherwise."""
    if lossy:
        whole = {"pairs": torch.ones(count * (4 + torch.empty((), dtype=dtype).element_size()), dtype=torch.bool)}
        share = decode_pairs(tensors, whole, numel, dtype, count)
        return Shared(share.values, share.mask)
    bitmap = -(-numel // 8)
    if sends_indices(count, numel):
        expect(tensors, {"values": (dtype, (count,)), "indices": (torch.int32, (count,))})
        positions = tensors["indices"].to(torch.int64)
        _check_rising(positions, numel)
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


def decode_pairs(tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], numel: int, dtype: torch.dtype,
                 count: int) -> Shared:
    """What arrived of ``encode_sparse``'s ``lossy`` pairs (``present``: their bytes that
    arrived): the values of the pairs that arrived whole and, as ``unsure``, the positions between
    the pairs around each lost run, where its values may have been. ValueError where what arrived
    does not fit together."""
    width = 4 + torch.empty((), dtype=dtype).element_size()
    expect(tensors, {"pairs": (torch.uint8, (count * width,))})
    rows = tensors["pairs"].view(count, width)
    arrived = present["pairs"].view(count, width).all(1)
    positions = rows[:, :4].contiguous().view(torch.int32).view(-1).to(torch.int64)
    _check_rising(positions[arrived], numel)
    unsure = torch.zeros(numel, dtype=torch.bool)
    for start, stop in _runs(~arrived):  # the lost pairs lie between the ones around them
        low = int(positions[start - 1]) + 1 if start > 0 else 0
        unsure[low:int(positions[stop]) if stop < count else numel] = True
    values, mask = torch.zeros(numel, dtype=dtype), torch.zeros(numel, dtype=torch.bool)
    values[positions[arrived]] = finite(rows[arrived, 4:].contiguous().view(dtype).view(-1))
    mask[positions[arrived]] = True
    return Shared(values, mask, unsure if bool(unsure.any()) else None)


def _check_rising(positions: torch.Tensor, numel: int) -> None:
    """ValueError unless ``positions`` rise strictly inside the state."""
    if len(positions) and (int(positions[0]) < 0 or int(positions[-1]) >= numel or
                           not bool((positions[1:] > positions[:-1]).all())):
        raise ValueError(f"indices must rise strictly inside 0 .. {numel - 1}")


def _runs(flags: torch.Tensor) -> list[tuple[int, int]]:
    """The [start, stop) ranges where ``flags`` (bool) are True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], flags.numpy().astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))
