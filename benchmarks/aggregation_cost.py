"""Time per aggregation of each rule, for one node with ``--neighbours`` neighbours (its own model
plus theirs), against ``mean``, side by side in one run.

    python benchmarks/aggregation_cost.py                     # ResNet-18-sized states, 16 neighbours
    python benchmarks/aggregation_cost.py --parameters 17226  # the digits MLP

Each rule runs ``--repeats`` times after one warm-up; the table gives the median and its ratio to
``mean``'s. States are float32, random (the rules' cost does not depend on the values).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from meshlearn.aggregation import get_rule

RULES = ["mean", "clip", "clip:1", "clip:nearest", "filter", "trimmed-mean:1", "trimmed-mean:4", "median", "krum:4",
         "multi-krum:4:8"]
RESNET18 = 11_183_582  # meshlearn's resnet18 for 10 classes: its flat state (parameters and buffers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parameters", type=int, default=RESNET18)
    parser.add_argument("--neighbours", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    k = args.neighbours + 1
    generator = torch.Generator().manual_seed(0)
    models = torch.randn(k, args.parameters, generator=generator) * 0.05
    weights = torch.full((k,), 1.0 / k, dtype=torch.float64)
    print(f"{args.parameters:,} parameters, {args.neighbours} neighbours ({k} models, "
          f"{models.numel() * 4 / 2 ** 20:.0f} MiB), {torch.get_num_threads()} threads")
    times = {}
    for name in RULES:
        rule = get_rule(name)
        rule(models, weights)  # warm-up
        samples = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            rule(models, weights)
            samples.append(time.perf_counter() - start)
        times[name] = statistics.median(samples)
    print("| rule | time per aggregation (ms) | x mean |")
    print("|---|---:|---:|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds * 1000:.1f} | {seconds / times['mean']:.1f} |")


if __name__ == "__main__":
    main()
