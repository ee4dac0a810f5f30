"""Gossip vs D-PSGD with and without a straggler, in one run.

1. Stragglers: N nodes, node 0 trains `--slowdown` times slower (it sleeps after each step).
   Time for the nodes' mean test accuracy to reach `--target` (each node counted with its latest
   evaluation, since gossip nodes evaluate at different moments). D-PSGD waits for the straggler
   every iteration; gossip should not.
2. No straggler: final mean accuracy of both after the same number of iterations (same samples).

    python benchmarks/stragglers.py [--nodes 8] [--target 0.85] [--slowdown 3] [--iterations 150]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from meshlearn.config import make_config
from meshlearn.sim import simulate
from meshlearn.sim.report import final_summary, load_logs


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--iterations", type=int, default=150)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    out = Path(args.output or tempfile.mkdtemp(prefix="stragglers-"))
    base = {"nodes": args.nodes, "topology": "regular:3", "dataset": "digits", "model": "mlp", "partition": "iid",
            "rounds": 10, "batch_size": 32, "lr": 0.05, "iterations": args.iterations, "test_after": 5,
            "seed": 90, "fetch_timeout": 1.0}
    rows = []
    for straggler in (True, False):
        for algorithm in ("dpsgd", "gossip"):
            name = f"{algorithm}-{'straggler' if straggler else 'even'}"
            config = make_config({**base, "algorithm": algorithm, "output": str(out / name),
                                  "slowdown": f"0:{args.slowdown:g}" if straggler else ""})
            print(f"running {name} ...", file=sys.stderr, flush=True)
            result = simulate(config, progress=False)
            summary = final_summary(load_logs(result.output))
            rows.append((name, time_to_target(result.output, args.target), summary["final"]["accuracy"],
                         summary["elapsed_max"]))
    print(f"{args.nodes} nodes, digits, mlp, rounds 10, batch 32, {args.iterations} iterations; "
          f"straggler: node 0 x{args.slowdown:g}; target {args.target:.0%}")
    print(f"| run | time to {args.target:.0%} (s) | final accuracy | slowest node done (s) |")
    print("|---|---|---|---|")
    for name, reach, accuracy, elapsed in rows:
        print(f"| {name} | {reach:.2f} | {accuracy:.4f} | {elapsed:.1f} |")
    speedup = rows[0][1] / rows[1][1] if rows[1][1] else float("nan")
    print(f"with the straggler, gossip reaches {args.target:.0%} {speedup:.2f}x faster than D-PSGD")
    print(f"without it, gossip's final accuracy is {(rows[3][2] - rows[2][2]) * 100:+.2f} points from D-PSGD's")
    print(f"runs: {out}")


if __name__ == "__main__":
    main()
