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


@register_sharing
class Quantize(Sharing):
    """``bits`` per value (1, 2, 4 or 8) plus a float32 low end and step per bucket of 512 values;
    rounding is stochastic (drawn from the run's seed, the sender and the iteration), so a
    received value is the sent one on average."""

    name = "quantize"

    def __init__(self, numel: int, dtype: torch.dtype, seed: int, bits: int):
        super().__init__(numel, dtype, seed)
        self.bits, self.levels = int(bits), (1 << int(bits)) - 1
        self.buckets = -(-numel // BUCKET)

    def encode(self, vector: torch.Tensor, sender: int, iteration: int) -> dict[str, torch.Tensor]:
        padding = (0, self.buckets * BUCKET - self.numel)
        values = torch.nn.functional.pad(vector.detach().cpu().to(torch.float32), padding).view(self.buckets, BUCKET)
        low, high = values.min(1).values, values.max(1).values
        step = (high - low) / self.levels
        scaled = (values - low[:, None]) / step.clamp_min(torch.finfo(torch.float32).tiny)[:, None]
        noise = torch.rand(values.shape, generator=seeded_generator(self.seed, SALT, sender, iteration))
        codes = (scaled + noise).floor_().clamp_(0, self.levels)
        return {"codes": pack_bits(codes.view(-1).to(torch.uint8), self.bits), "low": low, "step": step}

    def decode(self, tensors: dict[str, torch.Tensor], sender: int, iteration: int) -> Shared:
        expect(tensors, {"codes": (torch.uint8, (self.buckets * BUCKET * self.bits // 8,)),
                         "low": (torch.float32, (self.buckets,)), "step": (torch.float32, (self.buckets,))})
        low, step = finite(tensors["low"], "bucket low ends"), finite(tensors["step"], "bucket steps")
        if bool((step < 0).any()):
            raise ValueError("a bucket's step is negative")
        codes = unpack_bits(tensors["codes"], self.bits, self.buckets * BUCKET).view(self.buckets, BUCKET)
        values = (low[:, None] + codes.to(torch.float32) * step[:, None]).view(-1)[:self.numel]
        return Shared(finite(values.to(self.dtype), "decoded values"))

    def __str__(self) -> str:
        return f"quantize:{self.bits}"
