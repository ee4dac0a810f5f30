"""Differential privacy's cost in accuracy, side by side in one run: FedAvg and D-PSGD on
Fashion-MNIST (batched engine, 10 nodes, an MLP), each without DP at two learning rates and with
DP-SGD at (epsilon 8, delta 1e-5); then each private run's epsilon checked against Opacus' own
accountant for the same noise, sample rate and steps. Usage:

    python benchmarks/private_training.py --data ../shared/datasets/fashion-mnist [--iterations 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNS = [  # (algorithm, learning rate, dp)
    ("fedavg", 0.1, "none"), ("fedavg", 0.5, "none"), ("fedavg", 0.5, "epsilon=8,delta=1e-5"),
    ("dpsgd", 0.1, "none"), ("dpsgd", 0.5, "none"), ("dpsgd", 0.5, "epsilon=8,delta=1e-5"),
]


def run(folder: Path, data: str, algorithm: str, lr: float, dp: str, iterations: int) -> tuple[dict, float]:
    """One simulation's summary and wall-clock seconds."""
    began = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--engine", "batched", "--nodes", "10",
                           "--algorithm", algorithm, "--dataset", f"fashion-mnist:{data}", "--model", "mlp",
                           "--iterations", str(iterations), "--rounds", "10", "--batch-size", "64", "--lr", str(lr),
                           "--seed", "1", "--dp", dp, "--output", str(folder)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    return json.loads((folder / "summary.json").read_text()), time.perf_counter() - began


def opacus_epsilon(node: dict) -> float:
    """Opacus' RDP accountant's epsilon (its default orders) for a node's noise, sample rate and steps."""
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(node["noise_multiplier"], node["sample_rate"], node["steps"])]
    return accountant.get_epsilon(node["delta"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="the Fashion-MNIST folder (IDX files)")
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    print("| algorithm | lr | DP | test accuracy | epsilon (ours; Opacus' default orders) | noise multiplier | "
          "wall-clock |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for algorithm, lr, dp in RUNS:
            folder = Path(scratch) / f"{algorithm}-{lr}-{dp.split(',')[0]}"
            summary, seconds = run(folder, args.data, algorithm, lr, dp, args.iterations)
            privacy, spent, noise = summary.get("privacy"), "-", "-"
            if privacy:
                nodes = [n["privacy"] for n in summary["per_node"].values()]
                worst = max(nodes, key=lambda n: n["epsilon"])
                spent = f"{privacy['epsilon']:.3f}; {opacus_epsilon(worst):.3f}"
                noise = f"{privacy['noise_multiplier_min']:.3f}-{privacy['noise_multiplier_max']:.3f}"
            print(f"| {algorithm} | {lr} | {dp} | {summary['final']['accuracy']:.4f} | {spent} | {noise} | "
                  f"{seconds:.0f} s |", flush=True)


if __name__ == "__main__":
    main()
