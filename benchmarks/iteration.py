"""Iteration overhead of D-PSGD: the median iteration split into train / encode / send+wait /
average / eval, and the overhead (iteration minus train) as a share of train time.

Defaults are the DecentralizePy seed configuration (16 nodes, LeNet, CIFAR-10, 3-regular,
rounds 9, batch 8, 4 shards per node). Any `meshlearn simulate` flag may be added.

    python benchmarks/iteration.py --dataset cifar10:../shared/datasets/cifar10-jpeg.tar.gz \
        --iterations 40 --output runs/bench-iteration [--nodes 16 ...]
"""

from __future__ import annotations

import sys

from meshlearn.cli.main import build_parser
from meshlearn.sim import simulate, write_report

SEED_CONFIG = ["--nodes", "16", "--topology", "regular:3", "--model", "lenet", "--partition", "shards:4",
               "--rounds", "9", "--batch-size", "8", "--lr", "0.01", "--test-after", "20", "--seed", "90"]
PHASES = (("train", "train"), ("encode", "encode"), ("comm", "send+wait"), ("average", "average"), ("eval", "eval"))


def main(argv: list[str]) -> int:
    from meshlearn.cli.main import _resolve

    args = build_parser().parse_args(["simulate", "--quiet", *SEED_CONFIG, *argv])
    config = _resolve(args)
    result = simulate(config, progress=False)
    summary = write_report(result.output)
    times = summary["iteration_time"]
    print(f"{config.nodes} nodes, {config.model}, {config.dataset}, rounds {config.rounds}, batch {config.batch_size}, "
          f"{config.iterations} iterations, {config.threads} thread(s) per node")
    print(f"{'phase':<10} {'median ms':>10} {'mean ms':>10}")
    for key, label in PHASES:
        if key in times:
            print(f"{label:<10} {times[key]['median'] * 1000:10.2f} {times[key]['mean'] * 1000:10.2f}")
    train, overhead = times["train"]["median"], times["overhead"]["median"]
    print(f"{'iteration':<10} {times['total']['median'] * 1000:10.2f} {times['total']['mean'] * 1000:10.2f}")
    print(f"overhead per iteration (encode + send+wait + average): median {overhead * 1000:.2f} ms = "
          f"{overhead / train * 100:.1f}% of the median train time; mean {times['overhead']['mean'] * 1000:.2f} ms")
    print(f"final accuracy {summary['final']['accuracy']:.4f}; results in {result.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
