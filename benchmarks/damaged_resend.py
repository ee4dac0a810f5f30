"""What a damaged model costs a D-PSGD network task over TCP: every second model flipped on the way.

The task is ``tests/test_tamper.py``'s (4 providers on loopback, built as ``network.taskrun``
builds them: every engine message sealed with the task's key; MLP on digits, 20 epochs). Each
provider's engine endpoint stands behind a ``helpers.tamper`` proxy that flips one bit of every
second model sent to it, and the wait for a model (``peer_timeout``) is 120 s, so a damaged model
waited for would stall the run; a refused one is sent again at once (``transport.tcp``). Runs
alternate with the clean task (same seed), the order swapped every pair (clean flipped, flipped
clean, ...); each pair's ratios (flipped / clean) of wall seconds and of CPU seconds (the process's:
the providers are its threads) are printed, then their medians and ranges, with each run's
accuracy, the models damaged and sent again, and the load.

    python benchmarks/damaged_resend.py [--pairs 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_tamper import FLIPPED, PATIENT, PROVIDERS, _run  # noqa: E402  (the tests' own task and proxies)


def _cpu() -> float:
    """CPU seconds (user + system) of this process so far (the providers are its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _one(flipped: bool) -> dict:
    """One run of the task, clean or with every second model flipped; what it came to."""
    load, cpu = os.getloadavg()[0], _cpu()
    if flipped:
        run = _run("dpsgd", "flip", behind=tuple(range(PROVIDERS)), tampering=FLIPPED, peer_timeout=PATIENT)
    else:
        run = _run("dpsgd", peer_timeout=PATIENT)
    timeouts = sum(node.transport.stats.gather_timeouts for node in run.nodes)
    row = {"run": "flipped" if flipped else "clean", "seconds": run.seconds, "cpu": _cpu() - cpu,
           "accuracy": run.accuracy, "tampered": run.tampered, "resent": run.resent, "timeouts": timeouts, "load": load}
    print(f"  {row['run']:8s} {run.seconds:6.2f} s wall, {row['cpu']:6.2f} s CPU, accuracy {run.accuracy:.4f}, "
          f"damaged {run.tampered}, sent again {run.resent}, deadlines {timeouts}, load {load:.2f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5, help="alternated pairs of runs (at least 3)")
    args = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores, load at start {os.getloadavg()[0]:.2f}")
    ratios: dict[str, list[float]] = {"seconds": [], "cpu": []}
    for pair in range(args.pairs):
        order = (False, True) if pair % 2 == 0 else (True, False)
        print(f"pair {pair + 1}:")
        rows = {row["run"]: row for row in (_one(flipped) for flipped in order)}
        for measure, kept in ratios.items():
            kept.append(rows["flipped"][measure] / rows["clean"][measure])
        print(f"  ratio {ratios['seconds'][-1]:.2f} wall, {ratios['cpu'][-1]:.2f} CPU; accuracy difference "
              f"{rows['flipped']['accuracy'] - rows['clean']['accuracy']:+.4f}")
    for measure, kept in ratios.items():
        print(f"flipped / clean {'wall' if measure == 'seconds' else 'CPU'} seconds: median "
              f"{statistics.median(kept):.2f}, range {min(kept):.2f}-{max(kept):.2f} over {len(kept)} pairs")
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
