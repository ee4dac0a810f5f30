"""How fast this machine's cores run one training step: the FLOP rate the FLOP limit assumes.

The model's step (forward and backward matrix products, counted by ``torch.utils.flop_counter``)
as a plain PyTorch loop on one thread (``torch.optim.SGD``, the same batch again), best of five
runs of ``--steps`` steps, and one 2048^3 matrix product on one thread. It prints the CPU seconds a
step takes, the GFLOP/s that makes, and what ``--node-steps`` such steps cost.

    python3 benchmarks/step_speed.py [--model mlp] [--shape 1 28 28] [--classes 10] [--batch 32]
        [--steps 1000] [--node-steps 20000]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from meshlearn.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--shape", type=int, nargs=3, default=(1, 28, 28), help="one sample's C H W")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--node-steps", type=int, default=20000, help="the job's steps, to price")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(args.model, tuple(args.shape), args.classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(args.batch, *args.shape), torch.randint(0, args.classes, (args.batch,))
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), y).backward()
    flops = counter.get_total_flops()

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()

    for _ in range(args.steps // 5):
        step()
    best = float("inf")
    for _ in range(5):
        began = time.process_time()
        for _ in range(args.steps):
            step()
        best = min(best, (time.process_time() - began) / args.steps)
    print(f"{args.model}, batch {args.batch}: {flops / 1e6:.1f} MFLOP a step, {best * 1e3:.3f} ms CPU a step "
          f"({flops / best / 1e9:.1f} GFLOP/s); {args.node_steps:,} steps: {args.node_steps * best:.1f} CPU s")
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    torch.mm(a, b)
    began = time.perf_counter()
    for _ in range(5):
        torch.mm(a, b)
    print(f"2048^3 matrix product, one thread: {2 * 2048 ** 3 * 5 / (time.perf_counter() - began) / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
    main()
