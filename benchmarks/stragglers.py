"""Gossip vs D-PSGD with and without a straggler, in one run.

Every step also sleeps `--step-ms` (a device-bound step: on a machine with fewer cores than nodes,
CPU-bound steps share the cores, and a straggler's idle time just goes to the others); the
straggler sleeps `--slowdown` times as long, so its steps take about that many times longer.

1. Stragglers: N nodes, node 0 trains `--slowdown` times slower.
   Time for the nodes' mean test accuracy to reach `--target` (each node counted with its latest
   evaluation, since gossip nodes evaluate at different moments). D-PSGD waits for the straggler
   every iteration; gossip should not.
2. No straggler: final mean accuracy of both after the same number of iterations (same samples).

    python benchmarks/stragglers.py [--nodes 8] [--targets 0.85 0.9] [--slowdown 3] [--iterations 100]
        [--dataset digits] [--eval-samples 0] [--model mlp] [--step-ms 20] [--lr 0.8] [--gossip-lr 0.8] [--tune 0.2 0.4 0.8 1.6]
        [--interpolation constant|clock|loss] [--test-after 1] [--seeds 1 2 3] [--fetch fresh|dpwa|both]

Learning rates matter more than anything here: a D-PSGD held to a small one makes any rival look
fast. ``--tune`` picks each algorithm's best rate without the straggler first, in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from meshlearn.config import make_config
from meshlearn.sim import simulate
from meshlearn.sim.summary import final_summary
from meshlearn.sim.tables import load_logs


def time_to_target(run: Path, target: float) -> float:
    """Seconds until the mean of every node's latest test accuracy reaches ``target`` (inf if never)."""
    logs = load_logs(run)
    evals = sorted((e["t"], rank, e["test_acc"]) for rank, events in logs.items() for e in events
                   if e.get("event") == "eval")
    latest: dict[int, float] = {}
    for t, rank, accuracy in evals:
        latest[rank] = accuracy
        if len(latest) == len(logs) and statistics.fmean(latest.values()) >= target:
            return t
    return float("inf")


def _slowdown(args, straggler: bool) -> str:
    if not args.step_ms:
        return f"0:{args.slowdown:g}" if straggler else ""
    every = f"*:+{args.step_ms:g}ms"
    return f"{every},0:+{args.step_ms * args.slowdown:g}ms" if straggler else every


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--targets", type=float, nargs="+", default=[0.85, 0.9, 0.92, 0.94])
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--dataset", default="digits", help="a dataset spec, e.g. fashion-mnist:../shared/datasets/fashion-mnist")
    parser.add_argument("--eval-samples", type=int, default=0, help="test samples per evaluation (0: all)")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--step-ms", type=float, default=20.0, help="sleep per step of every node (0: none)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.8, help="D-PSGD's learning rate")
    parser.add_argument("--gossip-lr", type=float, default=0.8, help="gossip's learning rate")
    parser.add_argument("--tune", type=float, nargs="*", default=None, metavar="LR",
                        help="first try each algorithm without the straggler at each of these learning rates and "
                             "compare each at its best (fastest to the last target), not at --lr / --gossip-lr")
    parser.add_argument("--test-after", type=int, default=1, help="evaluate every N iterations (the time resolution)")
    parser.add_argument("--interpolation", default="clock", help="gossip's interpolation: constant | clock | loss")
    parser.add_argument("--fetch", choices=("fresh", "dpwa", "both"), default="fresh",
                        help="gossip fetches the state a peer finishes meanwhile (fresh), the one it has (dpwa), or "
                             "run both side by side")
    parser.add_argument("--seeds", type=int, nargs="+", default=[90],
                        help="run every configuration once per seed (partitions, initial model, topology) and "
                             "report the mean time to each target: single runs on a shared machine vary by 20%%")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    out = Path(args.output or tempfile.mkdtemp(prefix="stragglers-"))
    base = {"nodes": args.nodes, "topology": "regular:3", "dataset": args.dataset, "model": args.model, "partition": "iid",
            "rounds": args.rounds, "batch_size": args.batch_size, "iterations": args.iterations,
            "test_after": args.test_after, "eval_samples": args.eval_samples, "fetch_timeout": 1.0, "interpolation": args.interpolation}

    variants = {"dpsgd": {"algorithm": "dpsgd"}}
    if args.fetch in ("fresh", "both"):
        variants["gossip"] = {"algorithm": "gossip", "fetch_fresh": True}
    if args.fetch in ("dpwa", "both"):
        variants["gossip-dpwa-fetch"] = {"algorithm": "gossip", "fetch_fresh": False}

    def run(variant: str, lr: float, straggler: bool, name: str) -> tuple[str, list[float], float, float]:
        """One configuration, once per seed: mean time to each target, mean final accuracy, slowest node."""
        reach, accuracy, elapsed = [], [], []
        for seed in args.seeds:
            config = make_config({**base, **variants[variant], "lr": lr, "seed": seed,
                                  "output": str(out / f"{name}-seed{seed}"), "slowdown": _slowdown(args, straggler)})
            print(f"running {name} (lr {lr:g}, seed {seed}) ...", file=sys.stderr, flush=True)
            result = simulate(config, progress=False)
            summary = final_summary(load_logs(result.output))
            reach.append([time_to_target(result.output, t) for t in args.targets])
            accuracy.append(summary["final"]["accuracy"])
            elapsed.append(summary["elapsed_max"])
        return (name, [statistics.fmean(times) for times in zip(*reach)], statistics.fmean(accuracy), max(elapsed))

    lrs = {variant: args.lr if variant == "dpsgd" else args.gossip_lr for variant in variants}
    even: dict[str, tuple] = {}
    if args.tune:
        print("| tuning run, no straggler | " + " | ".join(f"to {t:.0%} (s)" for t in args.targets) + " | final accuracy |")
        print("|---|" + "---|" * (len(args.targets) + 1))
        for variant in lrs:
            tried = {lr: run(variant, lr, False, f"tune-{variant}-{lr:g}") for lr in args.tune}
            for lr, (name, reach, accuracy, _) in tried.items():
                print(f"| {name} | {' | '.join(f'{r:.2f}' for r in reach)} | {accuracy:.4f} |")
            lrs[variant] = min(tried, key=lambda lr: (tried[lr][1][-1], -tried[lr][2]))
            even[variant] = (f"{variant}-even",) + tried[lrs[variant]][1:]
    rows = {variant: run(variant, lrs[variant], True, f"{variant}-straggler") for variant in lrs}
    evens = {variant: even.get(variant) or run(variant, lrs[variant], False, f"{variant}-even") for variant in lrs}
    print(f"{args.nodes} nodes, {args.dataset}, {args.model}, rounds {args.rounds}, batch {args.batch_size}, {args.iterations} "
          f"iterations; seeds {' '.join(map(str, args.seeds))} (times are means over them); straggler: node 0 x{args.slowdown:g}; "
          f"sleep per step {args.step_ms:g} ms; lr: " + ", ".join(f"{variant} {lr:g}" for variant, lr in lrs.items())
          + f" ({args.interpolation} interpolation)")
    targets = " | ".join(f"to {t:.0%} (s)" for t in args.targets)
    print(f"| run | {targets} | final accuracy | slowest node done (s) |")
    print("|---|" + "---|" * (len(args.targets) + 2))
    for name, reach, accuracy, elapsed in [*rows.values(), *evens.values()]:
        print(f"| {name} | {' | '.join(f'{r:.2f}' for r in reach)} | {accuracy:.4f} | {elapsed:.1f} |")
    for variant in [v for v in variants if v != "dpsgd"]:
        ratios = " / ".join(f"{dpsgd / gossip:.2f}x" if gossip < float("inf") else "never"
                            for dpsgd, gossip in zip(rows["dpsgd"][1], rows[variant][1]))
        print(f"with the straggler, {variant} reaches {' / '.join(f'{t:.0%}' for t in args.targets)} {ratios} as fast as D-PSGD")
        print(f"without it, {variant}'s final accuracy is {(evens[variant][2] - evens['dpsgd'][2]) * 100:+.2f} points from D-PSGD's")
    print(f"runs: {out}")


if __name__ == "__main__":
    main()
