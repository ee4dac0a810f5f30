"""Issue 17: the CloudMesh `digits` task end to end, encrypted (this tree) against signed plaintext
(another checkout of meshlearn, say the commit before encryption), side by side.

Each run starts a bootstrap, ``--providers`` providers and a requester as real processes on
loopback (`meshlearn bootstrap | provider | request`), runs one task on `digits` (leader, as
CloudMesh, unless ``--algorithm``) with a fixed seed, and records the requester's wall time
(start to exit), the task's training time (from metrics.json) and its accuracy. Runs alternate
between the two trees, ``--rounds`` times.

    git worktree add /tmp/plain COMMIT_BEFORE_ENCRYPTION
    python benchmarks/network_task.py --plain-src /tmp/plain/src [--rounds 3] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE_SRC = Path(__file__).resolve().parents[1] / "src"
TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--seed", "7"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(path: Path, pattern: str, proc: subprocess.Popen, timeout: float = 60) -> re.Match | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.search(pattern, path.read_text())
        if found:
            return found
        if proc.poll() is not None:
            raise RuntimeError(f"{path.name} exited:\n{path.read_text()}")
        time.sleep(0.05)
    return None


def run_task(src: Path, providers: int, epochs: int, algorithm: str) -> dict:
    """One task on a fresh network of processes from the meshlearn tree ``src``."""
    folder = Path(tempfile.mkdtemp(prefix="meshlearn-bench-"))
    env = {**os.environ, "PYTHONPATH": str(src), "MESHLEARN_SECRET": "benchmark-secret-0123",
           "MESHLEARN_HOME": str(folder / "home"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> tuple[subprocess.Popen, Path]:
        log = folder / f"{name}.log"
        with open(log, "w") as out:  # the child keeps its own copy of the descriptor
            proc = subprocess.Popen([sys.executable, "-m", "meshlearn", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append(proc)
        return proc, log

    try:
        port = _free_port()
        boot, boot_log = start("bootstrap", "bootstrap", "--port", str(port), "--state", str(folder / "reg.sqlite"))
        pinned = _wait(boot_log, r"other machines give --bootstrap (\S+)", boot, timeout=15)
        address = pinned.group(1) if pinned else f"127.0.0.1:{port}"  # a tree without keys prints none
        for i in range(providers):
            start(f"p{i}", "provider", "--bootstrap", address, "--id", f"p{i}", "--workdir", str(folder / f"p{i}"))
        for i in range(providers):
            _wait(folder / f"p{i}.log", "registered with", procs[1 + i])
        began = time.perf_counter()
        request, log = start("request", "request", "--bootstrap", address, *TASK, "--algorithm", algorithm,
                             "--epochs", str(epochs),
                             "--providers", str(providers), "--output", str(folder / "out"))
        if request.wait(timeout=600) != 0:
            raise RuntimeError(f"the task failed:\n{log.read_text()}")
        wall = time.perf_counter() - began
        metrics = json.loads((folder / "out" / "metrics.json").read_text())
        return {"wall": wall, "training": metrics["training_time"], "accuracy": metrics["accuracy"]}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plain-src", required=True, help="src/ folder of a meshlearn checkout without encryption")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree, alternating (default: 3)")
    parser.add_argument("--providers", type=int, default=2, help="providers (default: 2)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs (default: 3)")
    parser.add_argument("--algorithm", default="leader",
                        help="leader (CloudMesh's), dpsgd or gossip (default: leader)")
    parser.add_argument("--names", nargs=2, default=["encrypted (this tree)", "signed plaintext (--plain-src)"],
                        metavar=("THIS", "OTHER"), help="what to call this tree and the other one in the table")
    args = parser.parse_args()
    trees = {args.names[0]: HERE_SRC, args.names[1]: Path(args.plain_src)}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_ in range(args.rounds):  # the order swapped each round: neither tree always runs first
        for name in (list(trees) if round_ % 2 == 0 else list(trees)[::-1]):
            runs[name].append(run_task(trees[name], args.providers, args.epochs, args.algorithm))
            print(name, runs[name][-1], flush=True)
    print(f"\n{args.providers} providers, {args.epochs} epochs, {args.algorithm}, digits, seed 7; "
          f"{args.rounds} runs each")
    print("| tree | wall (median) | training (median) | accuracy (each run) |\n|---|---|---|---|")
    for name, results in runs.items():
        print(f"| {name} | {statistics.median(r['wall'] for r in results):.1f} s | "
              f"{statistics.median(r['training'] for r in results):.2f} s | "
              f"{', '.join(format(r['accuracy'], '.4f') for r in results)} |")
    this, other = (runs[name] for name in trees)
    for key in ("wall", "training"):
        ratios = sorted(a[key] / b[key] for a, b in zip(this, other))
        print(f"{key}: {args.names[0]} / {args.names[1]}, per pair: median {statistics.median(ratios):.3f}x "
              f"(range {ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
