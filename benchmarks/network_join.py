"""A provider joining a running task (leader, fedavg, gossip or dpsgd), beside the same task with every
provider from the start (real processes on loopback: a bootstrap, providers, a requester).

Each pair, one seed: the task on ``--providers`` providers from the start, twice (how far apart two
runs end: the noise floor); then the same task
(``--min-providers`` one fewer) started on one provider fewer, the last provider started once the
slowest provider reached epoch ``--join-at``. Printed per pair: both accuracies and their gap in
points, the epoch the newcomer joined at, and the seconds from starting its process to its first
training cycle (process start, registration, claim, shard and model download, join).

    python benchmarks/network_join.py --providers 5 --epochs 10 --join-at 3 --repeats 3 [--algorithm fedavg]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.netproc import Processes, repeated_pairs, start_network  # noqa: E402


def _slowest(log: str, epochs: int) -> float:
    """The slowest provider's epoch, from the requester's latest status line (0 before one)."""
    lines = [line for line in log.splitlines() if ": training " in line]
    done = [(int(m.group(1)), int(m.group(2))) for m in re.finditer(r"training (\d+)/(\d+)", lines[-1])] \
        if lines else []
    return min(cycle * epochs / total for cycle, total in done) if done else 0.0


def pair(folder: Path, args: argparse.Namespace, seed: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    procs = Processes(folder)
    try:
        bootstrap, ids = start_network(procs, args.providers - 1, ttl=4.0)
        task = ["--bootstrap", bootstrap, "--data", args.data, "--model", "mlp", "--lr", "0.05", "--batch-size", "16",
                "--aggregate-every", str(args.aggregate_every), "--wait", "0", "--algorithm", args.algorithm,
                "--epochs", str(args.epochs), "--providers", str(args.providers), "--seed", str(seed)]
        procs.start("extra", "provider", "--bootstrap", bootstrap, "--id", "extra", "--host", "127.0.0.1",
                    "--workdir", str(folder / "extra"))
        procs.wait_for("extra", "registered with")
        for run in ("whole", "again"):  # twice: how far apart two runs of the same task end (the noise floor)
            proc = procs.start(run, "request", *task, "--output", str(folder / run))
            assert proc.wait(timeout=900) == 0, procs.log(run)
        procs.kill("extra")  # gone: the next task starts one provider short
        time.sleep(6)  # its registration expires (ttl 4 s)
        procs.start("joined", "request", *task, "--min-providers", str(args.providers - 1),
                    "--output", str(folder / "joined"))
        while _slowest(procs.log("joined"), args.epochs) < args.join_at:
            assert procs.procs["joined"].poll() is None, procs.log("joined")
            time.sleep(0.05)
        started = time.monotonic()
        procs.start("late", "provider", "--bootstrap", bootstrap, "--id", "late", "--host", "127.0.0.1",
                    "--workdir", str(folder / "late"))
        procs.wait_for("joined", r"late: training (\d+)/", timeout=120, accept=lambda m: int(m.group(1)) > 0)
        training_s = time.monotonic() - started
        assert procs.procs["joined"].wait(timeout=900) == 0, procs.log("joined")
        first = re.search(r"late: training (\d+)/(\d+)", procs.log("joined"))
        accuracy = [json.loads((folder / run / "metrics.json").read_text())["accuracy"]
                    for run in ("whole", "again", "joined")]
        return {"seed": seed, "all_from_start": accuracy[0], "again": accuracy[1], "one_joined": accuracy[2],
                "gap_points": 100 * (accuracy[2] - accuracy[0]), "noise_points": 100 * (accuracy[1] - accuracy[0]),
                "joined_at_epoch": int(first.group(1)) * args.epochs / int(first.group(2)),
                "training_after_s": training_s}
    finally:
        procs.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--providers", type=int, default=5)
    parser.add_argument("--algorithm", default="leader", choices=["leader", "fedavg", "gossip", "dpsgd"])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--data", default="fashion-mnist:../shared/datasets/fashion-mnist",
                        help="the task's data (default: Fashion-MNIST, whose epochs last seconds: a digits epoch is "
                        "over before a provider process has started)")
    parser.add_argument("--aggregate-every", type=int, default=50, help="batches per cycle (default 50)")
    parser.add_argument("--join-at", type=float, default=3.0, help="start the newcomer once the slowest provider "
                        "is at this epoch (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs, seeds 90, 91, ... (default 3)")
    args = parser.parse_args()
    rows = repeated_pairs(pair, args, "meshlearn-join-")
    gaps, noise = [row["gap_points"] for row in rows], [row["noise_points"] for row in rows]
    print(f"{args.algorithm}, {args.providers} providers, {args.epochs} epochs, one joining at epoch {args.join_at}: "
          "gap "
          f"{statistics.mean(gaps):+.2f} points mean (|max| {max(map(abs, gaps)):.2f}); two runs from the start "
          f"{statistics.mean(map(abs, noise)):.2f} apart (|max| {max(map(abs, noise)):.2f}); training "
          f"{max(row['training_after_s'] for row in rows):.1f} s at most after its process started")


if __name__ == "__main__":
    main()
