"""What secure aggregation costs per cycle: the synchronous leader on the process engine (real
processes, loopback TCP), the same run with and without ``--secure-aggregation``, side by side.

For each model and node count it runs both (same seed), and prints the median iteration time, the
median exchange time (``comm``: push to aggregate back, masking and unmasking included), the bytes
each node sends per iteration and the final accuracy. Usage:

    python benchmarks/secure_aggregation.py [--iterations 30] [--nodes 4 8] [--models mlp simplecnn]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run(folder: Path, nodes: int, model: str, iterations: int, secure: bool) -> dict:
    """One simulation's summary."""
    done = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--engine", "process", "--nodes", str(nodes),
                           "--algorithm", "leader", "--leader-sync", "true", "--leader-weighting", "samples",
                           "--secure-aggregation", str(secure).lower(), "--dataset", "digits", "--model", model,
                           "--iterations", str(iterations), "--seed", "7",
                           "--output", str(folder)], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-2000:] + done.stderr[-2000:])
    return json.loads((folder / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--nodes", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--models", nargs="+", default=["mlp", "simplecnn"])
    args = parser.parse_args()
    print("| model (parameters) | nodes | secure | iteration (median) | exchange (median) | sent per node and "
          "iteration | accuracy |")
    print("|---|---|---|---|---|---|---|")
    sizes = {"mlp": "17 k", "simplecnn": "164 k", "lenet": "79 k"}
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            for nodes in args.nodes:
                for secure in (False, True):
                    summary = run(Path(scratch) / f"{model}-{nodes}-{secure}", nodes, model, args.iterations, secure)
                    times = summary["iteration_time"]
                    print(f"| {model} ({sizes.get(model, '?')}) | {nodes} | {'yes' if secure else 'no'} | "
                          f"{1000 * times['total']['median']:.1f} ms | {1000 * times['comm']['median']:.1f} ms | "
                          f"{summary['bytes_per_iteration'] / 1e3:.0f} kB | {summary['final']['accuracy']:.3f} |",
                          flush=True)


if __name__ == "__main__":
    main()
