"""Start one `gossip_train.py` worker per name in a gossip config, on this machine, and wait for them.

    python examples/gossip_cluster.py --config examples/gossip-4.yaml [worker flags, e.g. --epochs 20]

Ctrl-C (or SIGTERM) stops every worker, each closing its endpoint on the way out; a worker that
fails stops the others. The exit status is 0 only if every worker finished: the first failing
worker's status, or 130 after Ctrl-C.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from meshlearn.adapter import load_gossip_config
from meshlearn.errors import MeshlearnError

TRAIN = Path(__file__).with_name("gossip_train.py")
STOP_WAIT = 10.0  # seconds a worker gets to close its endpoint before it is killed


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def stop(workers: dict[str, subprocess.Popen]) -> None:
    """Ask every running worker to stop (SIGTERM), then kill the ones still running after STOP_WAIT."""
    for proc in workers.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT
    for proc in workers.values():
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def supervise(workers: dict[str, subprocess.Popen]) -> int:
    """Wait for all workers; the first one to fail stops the rest. Returns the exit status."""
    while True:
        running = [name for name, proc in workers.items() if proc.poll() is None]
        failed = [name for name, proc in workers.items() if proc.returncode not in (None, 0)]
        if failed:
            name = failed[0]
            print(f"worker {name} failed (exit {workers[name].returncode}): stopping the others", file=sys.stderr)
            stop(workers)
            return workers[name].returncode if workers[name].returncode > 0 else 1
        if not running:
            return 0
        time.sleep(0.2)


def parser() -> argparse.ArgumentParser:
    """This script's own flags; any other goes to every worker (the README's test parses its
    commands with it, and the rest with gossip_train.py's)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Any other flag is passed to every worker (see gossip_train.py --help).")
    parser.add_argument("--config", required=True, help="dpwa or meshlearn gossip YAML naming the workers")
    parser.add_argument("--results", help="folder for each worker's result (NAME.json, NAME.json.npy)")
    return parser


def main() -> int:
    args, worker_flags = parser().parse_known_args()
    try:
        names = [node.name for node in load_gossip_config(args.config).nodes]
    except MeshlearnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.results:
        Path(args.results).mkdir(parents=True, exist_ok=True)
    # Workers ignore the terminal's SIGINT: this script turns Ctrl-C into one orderly SIGTERM each.
    signal.signal(signal.SIGTERM, _interrupt)
    workers: dict[str, subprocess.Popen] = {}
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the workers ...
        for name in names:
            result = ["--result", str(Path(args.results) / f"{name}.json")] if args.results else []
            workers[name] = subprocess.Popen(
                [sys.executable, str(TRAIN), "--config", args.config, "--name", name, *result, *worker_flags])
        signal.signal(signal.SIGINT, signal.default_int_handler)  # ... not by this script
        return supervise(workers)
    except KeyboardInterrupt:
        print(f"stopping {len(workers)} workers", file=sys.stderr)
        stop(workers)
        return 130


if __name__ == "__main__":
    sys.exit(main())
