"""Issue 18: what the batched engine does on this machine, side by side with the process engine.

Every run is a real `meshlearn simulate` in a child process (its peak RSS from getrusage):

- scale: 1,024 `mlp` nodes on digits, ring and 3-regular, 100 iterations (wall time, peak RSS,
  memory per node against one process-engine node's peak RSS);
- 16 `lenet` nodes on CIFAR-10, the UDP study's setting (rounds 9, batch 8, D-PSGD over TCP):
  wall-clock seconds per iteration, batched against process engine, runs alternating;
- the largest `lenet`/CIFAR-10 runs: N nodes for one iteration of one step (peak RSS, time).

    python benchmarks/batched_engine.py [--cifar ../shared/datasets/cifar10-jpeg.tar.gz] [--rounds 2]
        [--lenet-nodes 1024,4096] [--skip-scale]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WRAP = ("import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def simulate(args: list[str], output: Path) -> tuple[float, float]:
    """Run `meshlearn simulate` with ``args``; (wall seconds, peak RSS in MB of its largest process)."""
    command = [sys.executable, "-c", WRAP, sys.executable, "-m", "meshlearn", "simulate", "--quiet",
               "--output", str(output), *args]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise RuntimeError(f"meshlearn simulate {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return wall, int(done.stdout.strip().splitlines()[-1]) / 1024


def iteration_seconds(output: Path, engine: str) -> float:
    """Median wall-clock seconds per iteration of a finished run (the batched engine's log keeps
    real time apart from its modelled time)."""
    if engine == "process":
        return json.loads((output / "summary.json").read_text())["iteration_time"]["total"]["median"]
    walls = [json.loads(line)["wall"] for line in (output / "logs" / "nodes.jsonl").read_text().splitlines()
             if '"event":"iteration"' in line]
    return statistics.median(b - a for a, b in zip([0.0] + walls, walls))


def scale(folder: Path) -> None:
    print("## 1,024 mlp nodes on digits, 100 iterations, batched engine\n")
    print("| topology | wall | peak RSS | per node |\n|---|---|---|---|")
    for topology in ("ring", "regular:3"):
        wall, rss = simulate(["--engine", "batched", "--nodes", "1024", "--topology", topology, "--iterations", "100",
                              "--test-after", "20"], folder / f"scale-{topology}")
        print(f"| {topology} | {wall:.1f} s | {rss:.0f} MB | {rss / 1024:.2f} MB |")
    wall, rss = simulate(["--nodes", "4", "--iterations", "5"], folder / "process-4")
    print(f"\nprocess engine, 4 mlp nodes on digits: largest process {rss:.0f} MB (every node is such a process)\n")


def lenet(folder: Path, cifar: str, rounds: int, iterations: int) -> None:
    common = ["--nodes", "16", "--topology", "regular:3", "--dataset", f"cifar10:{cifar}", "--model", "lenet",
              "--partition", "shards:4", "--rounds", "9", "--batch-size", "8", "--lr", "0.01",
              "--iterations", str(iterations), "--test-after", "1000", "--eval-samples", "200"]
    times: dict[str, list[float]] = {"process": [], "batched": []}
    rss: dict[str, float] = {}
    for index in range(rounds):
        for engine in ("process", "batched"):
            output = folder / f"lenet-{engine}-{index}"
            _, rss[engine] = simulate([*common, "--engine", engine], output)
            times[engine].append(iteration_seconds(output, engine))
    print(f"## 16 lenet nodes on CIFAR-10, rounds 9, batch 8, D-PSGD; {iterations} iterations x {rounds} runs each\n")
    print("| engine | s per iteration (median of runs) | each run | peak RSS (largest process) |\n|---|---|---|---|")
    for engine, values in times.items():
        print(f"| {engine} | {statistics.median(values):.3f} | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{rss[engine]:.0f} MB |")
    ratio = statistics.median(times["process"]) / statistics.median(times["batched"])
    print(f"\nbatched is {ratio:.2f}x the process engine's speed\n")


def largest(folder: Path, cifar: str, counts: list[int]) -> None:
    print("## lenet on CIFAR-10, N nodes, one iteration of one step (rounds 1, batch 8)\n")
    print("| nodes | wall | peak RSS | per node |\n|---|---|---|---|")
    for nodes in counts:
        wall, rss = simulate(["--engine", "batched", "--nodes", str(nodes), "--topology", "regular:3", "--dataset",
                              f"cifar10:{cifar}", "--model", "lenet", "--rounds", "1", "--batch-size", "8",
                              "--iterations", "1", "--eval-nodes", "4", "--eval-samples", "200"],
                             folder / f"lenet-{nodes}")
        print(f"| {nodes} | {wall:.1f} s | {rss:.0f} MB | {rss / nodes:.2f} MB |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cifar", default="../shared/datasets/cifar10-jpeg.tar.gz", help="CIFAR-10 path")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each engine for lenet, alternating")
    parser.add_argument("--iterations", type=int, default=6, help="iterations of each lenet run")
    parser.add_argument("--lenet-nodes", default="1024,4096", help="node counts for the largest lenet runs")
    parser.add_argument("--skip-scale", action="store_true", help="leave out the 1,024-node mlp runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        if not args.skip_scale:
            scale(Path(folder))
        if Path(args.cifar).exists():
            lenet(Path(folder), args.cifar, args.rounds, args.iterations)
            largest(Path(folder), args.cifar, [int(n) for n in args.lenet_nodes.split(",") if n])
        else:
            print(f"{args.cifar} is not here: the lenet/CIFAR-10 rows are left out")


if __name__ == "__main__":
    main()
