"""A network task whose every process is SIGKILLed half-way, resumed with `request --resume`, beside
the same task run uninterrupted (real processes on loopback: a bootstrap, providers, a requester).

Each pair: the task run whole, twice (how far apart two uninterrupted runs end: the noise floor);
then run again, and once the requester holds every provider's checkpoint of the epoch before
``--kill-at`` (the slowest's) and half an epoch later, the requester and every provider are
SIGKILLed at once; the providers start again (same ids, same keys) and `meshlearn request
--resume TASK_ID` finishes the task. Printed per pair: the accuracies, the resumed run's gap in
points and the two uninterrupted runs', the epoch each provider went on from and where the
requester last saw it before the kill (its status lines, every half second: a lower bound), the
most epochs any provider trained again, and the seconds of each part.

    python benchmarks/network_resume.py --algorithm leader --providers 4 --epochs 10 --kill-at 5 --repeats 3
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

from meshlearn.network.task.state import KeptCheckpoints  # noqa: E402


def _reached(procs: Processes, ids: list[str]) -> list[int]:
    """The cycles each provider had finished when last seen, from the requester's status lines."""
    found = {pid: 0 for pid in ids}
    for match in re.finditer(r"(p\d+): training (\d+)/\d+", procs.log("cut")):
        found[match.group(1)] = max(found[match.group(1)], int(match.group(2)))
    return [found[pid] for pid in ids]


def pair(folder: Path, args: argparse.Namespace, seed: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    procs = Processes(folder)
    try:
        bootstrap, ids = start_network(procs, args.providers, ttl=4.0)
        task = ["--bootstrap", bootstrap, "--data", args.data, "--model", "mlp", "--lr", "0.05",
                "--batch-size", str(args.batch_size), "--aggregate-every", str(args.aggregate_every), "--wait", "0",
                "--algorithm", args.algorithm, "--epochs", str(args.epochs), "--providers", str(args.providers),
                "--seed", str(seed)]
        started = time.monotonic()
        whole = procs.start("whole", "request", *task, "--output", str(folder / "whole"))
        assert whole.wait(timeout=900) == 0, procs.log("whole")
        whole_s = time.monotonic() - started
        per_epoch = int(re.search(r"training \d+/(\d+)", procs.log("whole")).group(1)) / args.epochs  # cycles
        again = procs.start("again", "request", *task, "--output", str(folder / "again"))  # the noise floor
        assert again.wait(timeout=900) == 0, procs.log("again")
        started = time.monotonic()
        procs.start("cut", "request", *task, "--output", str(folder / "cut"))
        kept = KeptCheckpoints(folder / "cut")
        while min(kept.resume_cycles(args.providers, in_step=False) or [0]) < (args.kill_at - 1) * per_epoch:
            assert procs.procs["cut"].poll() is None, procs.log("cut")
            time.sleep(0.05)
        time.sleep(0.5 * whole_s / args.epochs)  # half-way through the epoch kill_at (about)
        reached = _reached(procs, ids)
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
        said = re.search(r"checkpoints of cycles? ([\d, ]+)", procs.log("resumed")).group(1)
        cycles = [int(c) for c in said.split(", ")] * (1 if "," in said else len(ids))
        accuracy = [json.loads((folder / run / "metrics.json").read_text())["accuracy"]
                    for run in ("whole", "cut", "again")]
        return {"seed": seed, "whole": accuracy[0], "resumed": accuracy[1], "gap_points": 100 * (accuracy[1] - accuracy[0]),
                "whole_again": accuracy[2], "noise_points": 100 * (accuracy[2] - accuracy[0]),
                "from_epochs": [c / per_epoch for c in cycles], "seen_epochs": [r / per_epoch for r in reached],
                "redone_epochs": max(max(0, r - c) for r, c in zip(reached, cycles)) / per_epoch,
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
    parser.add_argument("--data", default="digits")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--aggregate-every", type=int, default=1, help="batches per cycle (default 1: epochs of a "
                        "second or so on digits, long enough to kill one half-way)")
    args = parser.parse_args()
    rows = repeated_pairs(pair, args, "meshlearn-resume-")
    gaps = [abs(row["gap_points"]) for row in rows]
    noise = [abs(row["noise_points"]) for row in rows]
    print(f"{args.algorithm}, {args.providers} providers, {args.epochs} epochs, killed in epoch {args.kill_at}: "
          f"mean |gap| {statistics.mean(gaps):.2f} points (max {max(gaps):.2f}); two uninterrupted runs "
          f"{statistics.mean(noise):.2f} (max {max(noise):.2f}) apart; redone at most "
          f"{max(row['redone_epochs'] for row in rows):.2f} epochs")


if __name__ == "__main__":
    main()
