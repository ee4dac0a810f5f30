"""A small GPT (decoder-only transformer) for language modelling, nanoGPT's plain way: causal
self-attention, pre-norm blocks, learned positions, the output layer tied to the token embedding.

No dropout, so both engines compute the same models (and ``functional_call`` under ``vmap`` trains
it over nodes). Inputs are token ids [B, T] (T at most the dataset's context); outputs are logits
[B, T, vocabulary] for the next token at every position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from meshlearn.errors import ModelError
from meshlearn.models.registry import register_model


@dataclass(frozen=True)
class GPTShape:
    """A GPT's sizes: ``layers`` blocks of ``heads`` attention heads over ``width`` features."""

    layers: int
    heads: int
    width: int


class Block(nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP (4x wide, GELU)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        # written out, not scaled_dot_product_attention: vmap over nodes has no batching rule for it on the CPU
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // self.heads))
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        x = x + self.out(attended.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """A decoder-only transformer over ``vocabulary`` tokens and contexts of up to ``context``."""

    def __init__(self, context: int, vocabulary: int, shape: GPTShape):
        super().__init__()
        if shape.width % shape.heads:
            raise ValueError(f"width {shape.width} is not a multiple of {shape.heads} heads")
        self.context = context
        self.tokens = nn.Embedding(vocabulary, shape.width)
        self.positions = nn.Embedding(context, shape.width)
        self.blocks = nn.Sequential(*(Block(shape.width, shape.heads) for _ in range(shape.layers)))
        self.norm = nn.LayerNorm(shape.width)
        self._initialise(shape.layers)

    def _initialise(self, layers: int) -> None:
        """GPT-2's initialisation: normal(0.02), residual projections scaled by 1/sqrt(2 x layers)."""
        for name, parameter in self.named_parameters():
            if parameter.dim() < 2:
                continue
            std = 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "mlp.2.weight")) else 0.02
            nn.init.normal_(parameter, 0.0, std)
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[-1]
        x = self.tokens(tokens) + self.positions(torch.arange(t, device=tokens.device))
        x = self.norm(self.blocks(x))
        return x @ self.tokens.weight.T  # the output layer tied to the embedding


SHAPES = {"gpt-tiny": GPTShape(layers=4, heads=4, width=128), "gpt-small": GPTShape(layers=6, heads=6, width=384)}


def _factory(name: str):
    def build(input_shape: tuple[int, ...], num_classes: int) -> GPT:
        if len(input_shape) != 1:
            raise ModelError(f"{name} reads token sequences: use a text dataset (pystdlib, text:PATH), not "
                             f"samples of shape {tuple(input_shape)}")
        return GPT(int(input_shape[0]), num_classes, SHAPES[name])
    build.__doc__ = f"{name}: {SHAPES[name]} (context: the dataset's; vocabulary: its tokens)"
    return build


for _name in SHAPES:
    register_model(_name)(_factory(_name))
