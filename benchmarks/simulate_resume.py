"""`meshlearn simulate --resume` after a SIGKILL, beside the same run never interrupted, on both engines.

Per engine: the run whole; the run again, SIGKILLed (its whole process group: the launcher and
every node process) once its log holds iteration ``--kill-at``; then `simulate --resume FOLDER`.
Printed: the final accuracies, the largest difference between the final models (node 0's
`model.safetensors`; on the batched engine every node's final metrics too), the iteration the run
went on from, the checkpoints' size on disk, and the wall-clock seconds of each part.

    python benchmarks/simulate_resume.py --nodes 8 --iterations 100 --kill-at 50
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from meshlearn.checkpoint import FOLDER
from meshlearn.runlog import read_jsonl


def _simulate(*args: str) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "meshlearn", "simulate", *args, "--quiet"], check=True,
                   stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def _iterations(folder: Path) -> int:
    logs = list((folder / "logs").glob("*.jsonl"))
    counts = [sum(1 for e in read_jsonl(log) if e.get("event") == "iteration") for log in logs]
    return min(counts) if counts else 0


def engine_pair(root: Path, engine: str, args: argparse.Namespace) -> dict:
    argv = ["--engine", engine, "--nodes", str(args.nodes), "--iterations", str(args.iterations), "--test-after", "10",
            "--seed", "7", "--checkpoint-every", "10"]
    whole_s = _simulate(*argv, "--output", str(root / f"{engine}-whole"))
    cut = root / f"{engine}-cut"
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "meshlearn", "simulate", *argv, "--output", str(cut), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    while _iterations(cut) < args.kill_at and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    cut_s = time.monotonic() - started
    checkpoint_bytes = sum(f.stat().st_size for f in (cut / FOLDER).rglob("*") if f.is_file())
    resumed = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--resume", str(cut)],
                             capture_output=True, text=True, check=True)
    at = [line for line in resumed.stderr.splitlines() if line.startswith("resuming")][0]
    whole, again = (json.loads((root / f"{engine}-{run}" / "summary.json").read_text()) for run in ("whole", "cut"))
    models = load_file(root / f"{engine}-whole" / "model.safetensors"), load_file(cut / "model.safetensors")
    gap = max(float((models[0][k] - models[1][k]).abs().max()) for k in models[0])
    same_metrics = all(node["metrics"] == again["per_node"][rank]["metrics"] for rank, node in whole["per_node"].items())
    return {"engine": engine, "whole": whole["final"]["accuracy"], "resumed": again["final"]["accuracy"],
            "model_max_abs_diff": gap, "every_node_same_metrics": same_metrics, "resumed_at": at,
            "checkpoint_bytes": checkpoint_bytes, "whole_s": round(whole_s, 1), "cut_s": round(cut_s, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=100)
    parser.add_argument("--kill-at", type=int, default=50)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshlearn-resume-sim-"))
    torch.set_num_threads(1)
    for engine in ("batched", "process"):
        print(json.dumps(engine_pair(root, engine, args)), flush=True)


if __name__ == "__main__":
    main()
