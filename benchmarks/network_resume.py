"""A network task whose every process is SIGKILLed half-way, resumed with `request --resume`, beside
the same task run uninterrupted (real processes on loopback: a bootstrap, providers, a requester).

Each pair: the task run whole; then run again, and once the requester holds every provider's
checkpoint of the cycle before ``--kill-at`` (one cycle = one epoch by default) and half an epoch
later, the requester and every provider are SIGKILLed at once; the providers start again (same ids, same keys) and
`meshlearn request --resume TASK_ID` finishes the task. Printed per pair: both accuracies, their
gap in points, the epoch the resumed task went on from and how many epochs it redid (the furthest
provider's progress when killed, from the requester's last status line, less that), and the
seconds of each part.

    python benchmarks/network_resume.py --algorithm leader --providers 4 --epochs 10 --kill-at 5 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.netproc import Processes, start_network  # noqa: E402

from meshlearn.checkpoint import FOLDER, CheckpointStore  # noqa: E402


def _reached(procs: Processes, ids: list[str]) -> int:
    """The most cycles any provider had finished, from the requester's last status line."""
    found = [int(m.group(1)) for m in re.finditer(r"p\d+: training (\d+)/\d+", procs.log("cut"))]
    return max(found, default=0)


def pair(folder: Path, args: argparse.Namespace, seed: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    procs = Processes(folder)
    try:
        bootstrap, ids = start_network(procs, args.providers, ttl=4.0)
        task = ["--bootstrap", bootstrap, "--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "8",
                "--aggregate-every", "1", "--wait", "0", "--algorithm", args.algorithm, "--epochs", str(args.epochs),
                "--providers", str(args.providers), "--seed", str(seed)]
        per_epoch = -(-1437 // args.providers // 8)  # cycles an epoch: digits' 1,437 training samples, batch 8
        started = time.monotonic()
        whole = procs.start("whole", "request", *task, "--output", str(folder / "whole"))
        assert whole.wait(timeout=900) == 0, procs.log("whole")
        whole_s = time.monotonic() - started
        started = time.monotonic()
        procs.start("cut", "request", *task, "--output", str(folder / "cut"))
        names = [f"provider-{i}" for i in range(args.providers)]
        while (CheckpointStore(folder / "cut" / FOLDER).latest(names) or 0) < (args.kill_at - 1) * per_epoch:
            assert procs.procs["cut"].poll() is None, procs.log("cut")
            time.sleep(0.05)
        time.sleep(0.5 * whole_s / args.epochs)  # half-way through the epoch kill_at (about)
        reached = _reached(procs, ids) / per_epoch
        for name in ["cut", *ids]:
            procs.kill(name)
        cut_s = time.monotonic() - started
        for pid in ids:
            procs.start(f"{pid}-again", "provider", "--bootstrap", bootstrap, "--id", pid, "--host", "127.0.0.1",
                        "--workdir", str(folder / pid))
        for pid in ids:
            procs.wait_for(f"{pid}-again", "registered with")
        task_id = json.loads((folder / "cut" / "task.json").read_text())["task"]
        started = time.monotonic()
        resumed = procs.start("resumed", "request", "--bootstrap", bootstrap, "--resume", task_id,
                              "--output", str(folder / "cut"))
        assert resumed.wait(timeout=900) == 0, procs.log("resumed")
        resumed_s = time.monotonic() - started
        cycle = int(re.search(r"checkpoints of cycle (\d+)", procs.log("resumed")).group(1)) / per_epoch
        accuracy = [json.loads((folder / run / "metrics.json").read_text())["accuracy"] for run in ("whole", "cut")]
        return {"seed": seed, "whole": accuracy[0], "resumed": accuracy[1], "gap_points": 100 * (accuracy[1] - accuracy[0]),
                "from_epoch": cycle, "reached_epoch": reached, "redone_epochs": max(0.0, reached - cycle),
                "whole_s": whole_s,
                "cut_s": cut_s, "resumed_s": resumed_s}
    finally:
        procs.stop_all()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="leader")
    parser.add_argument("--providers", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=5, help="kill half-way through this epoch: once every "
                        "provider's checkpoint of the one before is in, and half an epoch's time later (default 5)")
    parser.add_argument("--repeats", type=int, default=3, help="pairs, seeds 90, 91, ... (default 3)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="meshlearn-resume-"))
    rows = []
    for k in range(args.repeats):
        row = pair(root / f"pair-{k}", args, 90 + k)
        rows.append(row)
        print(json.dumps({key: round(value, 4) if isinstance(value, float) else value for key, value in row.items()}),
              flush=True)
    gaps = [abs(row["gap_points"]) for row in rows]
    print(f"{args.algorithm}, {args.providers} providers, {args.epochs} epochs, killed at cycle {args.kill_at}: "
          f"mean |gap| {statistics.mean(gaps):.2f} points (max {max(gaps):.2f}), cycles redone at most "
          f"{max(row['redone_epochs'] for row in rows):.2f} epochs")


if __name__ == "__main__":
    main()
