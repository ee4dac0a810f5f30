"""Randomized chaos on the compute-sharing network: many trials, one process SIGKILLed in each.

Each trial starts a bootstrap and 4 providers, requests a digits task (leader, dpsgd or gossip),
SIGKILLs one process (a follower, the leader, or the bootstrap, restarted on its state file) at a
random moment of training, requests a second task right after, and stops everything with SIGTERM.
First one clean run per algorithm sets the accuracy a killed run is compared with.

    python benchmarks/chaos.py --trials 20 --seed 1 [--json runs/chaos.json]

Counts printed: results delivered, accuracy within 2 points of the clean run (and the mean gap
per kind of kill), providers shown busy after their task, second tasks that ran, processes
still running 10 s after SIGTERM. Trial logs stay under --folder.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.chaos import Trial, run_trial, summary  # noqa: E402

ALGORITHMS = ("leader", "dpsgd", "gossip")
KINDS = ("follower", "leader", "bootstrap")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="kill trials (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the trials' choices (default 1)")
    parser.add_argument("--epochs", type=int, default=25, help="epochs of each task (default 25)")
    parser.add_argument("--task-seed", type=int, default=90, help="the tasks' own seed (default 90)")
    parser.add_argument("--folder", help="where trial logs go (default: a temporary folder)")
    parser.add_argument("--json", help="write every outcome here")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    folder = Path(args.folder or tempfile.mkdtemp(prefix="meshlearn-chaos-"))
    print(f"logs: {folder}", flush=True)

    clean = {}
    for algorithm in ALGORITHMS:
        outcome = run_trial(folder / f"clean-{algorithm}", Trial(algorithm, seed=args.task_seed, epochs=args.epochs))
        clean[algorithm] = outcome.accuracy
        _show("clean", outcome)
    outcomes = []
    for index in range(args.trials):
        kind = rng.choice(KINDS)
        trial = Trial(rng.choice(ALGORITHMS), kind, seed=args.task_seed, at=rng.uniform(0.1, 0.9), epochs=args.epochs,
                      victim=f"p{rng.randint(1, 3)}" if kind == "follower" else "")
        outcome = run_trial(folder / f"trial-{index:02d}", trial)
        outcomes.append(outcome)
        _show(f"trial {index + 1:2d}", outcome, clean[trial.algorithm])

    counts = summary(outcomes)
    gaps = {kind: [clean[o.trial.algorithm] - o.accuracy for o in outcomes
                   if o.trial.kill == kind and o.accuracy is not None and clean[o.trial.algorithm] is not None]
            for kind in KINDS}
    counts["accuracy_within_2_points"] = sum(g <= 0.02 for kind in KINDS for g in gaps[kind])
    print("\nclean accuracy: " + ", ".join(f"{a} {c:.4f}" for a, c in clean.items() if c is not None))
    for kind in KINDS:
        if gaps[kind]:
            print(f"kill {kind:9s}: {len(gaps[kind])} trials, accuracy below the clean run by "
                  f"{statistics.fmean(gaps[kind]) * 100:+.2f} points on average (worst {max(gaps[kind]) * 100:+.2f})")
    print(json.dumps(counts, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"clean": clean, "counts": counts,
                                               "trials": [asdict(o) for o in outcomes]}, indent=2))


def _show(label: str, outcome, clean: float | None = None) -> None:
    t = outcome.trial
    accuracy = "-" if outcome.accuracy is None else f"{outcome.accuracy:.4f}"
    gap = "" if clean is None or outcome.accuracy is None else f" ({(outcome.accuracy - clean) * 100:+.2f})"
    print(f"{label}: {t.algorithm:6s} kill {t.kill:9s} {t.victim or '':3s} at {t.at:.2f}: delivered "
          f"{outcome.delivered}, accuracy {accuracy}{gap}, busy after {outcome.busy}, second task "
          f"{outcome.second}, left {outcome.left}, {outcome.seconds:.0f} s"
          + (f"\n    {outcome.problem[-300:]}" if outcome.problem else ""), flush=True)


if __name__ == "__main__":
    main()
