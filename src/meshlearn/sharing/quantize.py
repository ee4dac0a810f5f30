"""Quantization: every value in a few bits, by unbiased stochastic rounding (as QSGD, Alistarh et
al. 2017) onto evenly spaced levels between each bucket's smallest and largest value."""

from __future__ import annotations

import torch

from meshlearn.sharing.base import (
    Shared,
    Sharing,
    expect,
    finite,
    pack_bits,
    register_sharing,
    seeded_generator,
    unpack_bits,
)

BUCKET = 512  # values sharing one scale: more buckets, finer levels, more bytes (8 per bucket)
SALT = 0x0A7E
SCALES = 8  # bytes of a bucket's low end and step (float32 each)


@register_sharing
class Quantize(Sharing):
    """``bits`` per value (1, 2, 4 or 8) plus a float32 low end and step per bucket of 512 values;
    rounding is stochastic (drawn from the run's seed, the sender and the iteration), so a
    received value is the sent one on average. A message is its buckets one after another, each
    its low end and step, then its codes: a chunk lost on UDP loses the buckets it held, no more."""

    name = "quantize"

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, bits: int):
        super().__init__(numel, dtype, seed)
        self.bits, self.levels = int(bits), (1 << int(bits)) - 1
        self.buckets = -(-numel // BUCKET)
        self.width = SCALES + BUCKET * self.bits // 8  # bytes a bucket takes

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        padding = (0, self.buckets * BUCKET - self.numel)
        values = torch.nn.functional.pad(vector.detach().cpu().to(torch.float32), padding).view(self.buckets, BUCKET)
        low, high = values.min(1).values, values.max(1).values
        step = (high - low) / self.levels
        scaled = (values - low[:, None]) / step.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        noise = torch.rand(values.shape, generator=seeded_generator(self.seed, SALT, sender, iteration))
        codes = pack_bits((scaled + noise).floor_().clamp_(0, self.levels).view(-1).to(torch.uint8), self.bits)
        scales = torch.stack([low, step], 1).view(torch.uint8)  # [buckets, 8]
        return {"buckets": torch.cat([scales, codes.view(self.buckets, -1)], 1).view(-1)}

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        return Shared(self._values(tensors, torch.ones(self.buckets, dtype=torch.bool)))

    def decode_partial(self, tensors: dict[str, torch.Tensor], present: dict[str, torch.Tensor], sender: int,
                       iteration: int) -> Shared:
        """The values whose code and bucket scales (low end and step) arrived."""
        arrived = present["buckets"].view(self.buckets, self.width)
        scaled = arrived[:, :SCALES].all(1)
        codes = arrived[:, SCALES:].repeat_interleave(8 // self.bits, dim=1)  # [buckets, BUCKET]
        mask = (codes & scaled[:, None]).view(-1)[:self.numel]
        values = self._values(tensors, scaled)
        values[~mask] = 0
        return Shared(values, mask)

    def _values(self, tensors: dict[str, torch.Tensor], scaled: torch.Tensor) -> torch.Tensor:
        """The decoded values, checked in the buckets whose scales arrived (``scaled``; the others
        decode to anything)."""
        expect(tensors, {"buckets": (torch.uint8, (self.buckets * self.width,))})
        rows = tensors["buckets"].view(self.buckets, self.width)
        scales = torch.where(scaled[:, None], rows[:, :SCALES].contiguous().view(torch.float32), 0.0)
        low, step = finite(scales[:, 0], "bucket low ends"), finite(scales[:, 1], "bucket steps")
        if bool((step < 0).any()):
            raise ValueError("a bucket's step is negative")
        codes = unpack_bits(rows[:, SCALES:].contiguous().view(-1), self.bits, self.buckets * BUCKET)
        values = (low[:, None] + codes.view(self.buckets, BUCKET).to(torch.float32) * step[:, None]).view(-1)
        return finite(values[:self.numel].to(self.dtype), "decoded values")

    def __str__(self) -> str:
        return f"quantize:{self.bits}"
