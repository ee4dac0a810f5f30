"""A batched-engine run's iteration times on a quiet machine and under load: do iterations spike?

Runs `meshlearn simulate --engine batched ARGS` once quiet and once while `--load` busy-looping
processes compete for the cores, for each source tree given (`--tree NAME=SRC`, default: this
checkout; e.g. `--tree before=/work/wt-before/src` for another commit's `src`), alternating, and
prints each run's real seconds per iteration (median, 95th percentile, max; from the `wall` the
engine logs with every iteration) and CPU seconds.

    python benchmarks/loaded_iterations.py [--load 3] [--tree NAME=SRC ...] -- --nodes 100 --algorithm fedavg ...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def iteration_walls(output: Path) -> np.ndarray:
    """Real seconds of each iteration of a finished batched run."""
    walls = [json.loads(line)["wall"] for line in (output / "logs" / "nodes.jsonl").read_text().splitlines()
             if '"event":"iteration"' in line or '"event": "iteration"' in line]
    return np.diff(np.asarray([0.0] + walls))[1:]  # the first iteration also pays for warm-up


def run(src: str, args: list[str], output: Path) -> tuple[np.ndarray, float]:
    """One run with ``src`` first on the path: its iteration walls and CPU seconds."""
    env = {**os.environ, "PYTHONPATH": src}
    command = [sys.executable, "-m", "meshlearn", "simulate", "--quiet", "--engine", "batched", "--output",
               str(output), *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(process.pid, 0)
    if status:
        raise RuntimeError(f"{' '.join(command)} failed: {process.stderr.read()[-2000:]}")
    return iteration_walls(output), usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=int, default=3, help="busy-looping processes for the loaded runs")
    parser.add_argument("--tree", action="append", default=[], help="NAME=SRC: a source tree to run (repeatable)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the simulate arguments")
    options = parser.parse_args()
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    trees = dict(tree.split("=", 1) for tree in options.tree) or {"this": str(HERE.parent / "src")}
    print(f"`meshlearn simulate --engine batched {' '.join(args)}`, {time.strftime('%Y-%m-%d %H:%M')}, "
          f"load before {os.getloadavg()[0]:.2f}\n")
    print("| tree | machine | s per iteration: median | p95 | max | CPU s |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for loaded in (False, True):
            stop = multiprocessing.Event()
            spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True)
                        for _ in range(options.load if loaded else 0)]
            for spinner in spinners:
                spinner.start()
            try:
                for name, src in trees.items():
                    walls, cpu = run(src, args, Path(folder) / f"{name}-{loaded}")
                    print(f"| {name} | {f'{options.load} busy loops' if loaded else 'quiet'} | "
                          f"{np.median(walls):.3f} | {np.percentile(walls, 95):.3f} | {walls.max():.3f} | "
                          f"{cpu:.1f} |", flush=True)
            finally:
                stop.set()
                for spinner in spinners:
                    spinner.join()


if __name__ == "__main__":
    main()
