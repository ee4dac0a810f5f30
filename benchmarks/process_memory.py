"""Peak memory and start-up of a process-engine run: the summed PSS of the launcher and every node
process (sampled from ``/proc/PID/smaps_rollup``), with the run's own start-up and wall-clock lines.

    python3 benchmarks/process_memory.py [--nodes 256] [--iterations 20] [--interval 0.3] [-- EXTRA FLAGS]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (Linux ``/proc``)."""
    found = [pid]
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return found
    for child in children:
        found += descendants(int(child))
    return found


def summed_pss_kb(pids: list[int]) -> tuple[int, int]:
    """(summed Pss in kB, processes read) of ``pids``; those gone meanwhile are skipped."""
    total = count = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as rollup:
                total += next(int(line.split()[1]) for line in rollup if line.startswith("Pss:"))
                count += 1
        except (OSError, StopIteration):
            continue
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument("extra", nargs="*", help="more flags for meshlearn simulate (after --)")
    args = parser.parse_args()
    output = tempfile.mkdtemp(prefix="process-memory-")
    command = [sys.executable, "-m", "meshlearn", "simulate", "--nodes", str(args.nodes), "--iterations",
               str(args.iterations), "--output", output, *args.extra]
    began = time.perf_counter()
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    peak = peak_count = 0
    while run.poll() is None:
        total, count = summed_pss_kb(descendants(run.pid))
        if total > peak:
            peak, peak_count = total, count
        time.sleep(args.interval)
    printed = run.stdout.read()
    for line in printed.splitlines():
        if line.startswith(("wall-clock", "nodes finished", "test accuracy")):
            print(line)
    print(f"{args.nodes} nodes: peak summed PSS {peak / 1024:,.0f} MB over {peak_count} processes "
          f"({peak / 1024 / max(1, peak_count):.0f} MB each), {time.perf_counter() - began:.1f} s in all, "
          f"exit {run.returncode}; results in {output}")


if __name__ == "__main__":
    main()
