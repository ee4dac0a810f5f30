"""What each sharing scheme costs a node's CPU per D-PSGD iteration, side by side in one run:
encoding its model, decoding each neighbour's share, and averaging (or CHOCO-SGD's update).

    python benchmarks/sharing_cost.py                         # the Fashion-MNIST MLP, 3 neighbours
    python benchmarks/sharing_cost.py --parameters 11183582   # a ResNet-18-sized state

The neighbours' shares are encoded outside the timing (their own nodes do that); the wire and the
sockets are not included (benchmarks/exchange.py measures those). Median of ``--repeats`` after
one warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshlearn.definitions.averaging import masked_average_, weighted_average_
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.sharing import make_sharing

SCHEMES = ["full", "subsample:0.1", "topk:0.1", "quantize:8", "quantize:4", "choco:0.1"]


def one_iteration(models: torch.Tensor, schemes: list, iteration: int) -> float:
    """Node 0's exchange: it encodes its model, decodes its neighbours' shares (encoded before,
    by their own nodes) and averages; returns the seconds node 0 spent."""
    own, neighbours = models[0].clone(), range(1, len(models))
    sent = {j: schemes[j].encode(models[j], j, iteration) for j in neighbours}
    start = time.perf_counter()
    schemes[0].encode(own, 0, iteration)
    shared = {j: schemes[0].decode(sent[j], j, iteration) for j in neighbours}
    weight = 1.0 / len(models)
    if schemes[0].mixes:
        schemes[0].mix_(own, {j: weight for j in neighbours}, shared)
    elif all(s.mask is None for s in shared.values()):
        weighted_average_(own, weight, [(weight, s.values) for s in shared.values()])
    else:
        masked_average_(own, weight, [(weight, len(models) - 1, s.values, s.mask) for s in shared.values()],
                        MISSING_CHUNK_RULES["per-chunk"])
    schemes[0].averaged(own)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=109_386)  # meshlearn's mlp on 28x28 images
    parser.add_argument("--neighbours", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a node process uses 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    models = torch.randn(args.neighbours + 1, args.parameters, generator=torch.Generator().manual_seed(0)) * 0.05
    print(f"{args.parameters:,} parameters, {args.neighbours} neighbours, {torch.get_num_threads()} thread(s)")
    times = {}
    for name in SCHEMES:
        schemes = [make_sharing(name, args.parameters, torch.float32, seed=1) for _ in models]
        for scheme, model in zip(schemes, models):
            scheme.start(model * 0.99)
        runs = [one_iteration(models, schemes, iteration) for iteration in range(args.repeats + 1)]
        times[name] = statistics.median(runs[1:])
    print("| scheme | ms per iteration at one node (encode, decode, average) | x full |")
    print("|---|---:|---:|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1000:.2f} | {seconds / times['full']:.1f} |")


if __name__ == "__main__":
    main()
