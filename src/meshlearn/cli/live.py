"""``--dashboard`` and ``--tensorboard`` for simulate and experiment: what watches a local run."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Callable, Iterator

from meshlearn.config import ExperimentConfig


def add_live_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dashboard", metavar="[HOST:]PORT", default="",
                        help="serve a live web page of the run on PORT (loopback unless HOST is given; other "
                             "machines then need the printed token) (default: none)")
    parser.add_argument("--tensorboard", metavar="DIR", default="",
                        help="write TensorBoard event files under DIR/<run> as the run goes "
                             "(tensorboard --logdir DIR) (default: none)")


def check_live_flags(args: argparse.Namespace) -> None:
    """One-line errors for a bad --dashboard or a missing tensorboard package, before anything starts."""
    if args.dashboard:
        from meshlearn.dashboard.server import parse_listen
        from meshlearn.errors import PortInUseError, UserInputError
        from meshlearn.transport.ports import ensure_port_free

        host, port = parse_listen(args.dashboard)
        try:  # known before any node starts
            if port:
                ensure_port_free(host, port)
        except PortInUseError:
            raise UserInputError(f"--dashboard {args.dashboard}: port {port} on {host} is in use: give another port "
                                 "(or 0 for any free one)") from None
    if args.tensorboard:
        from meshlearn.tblog import require_tensorboard

        require_tensorboard()


def _torchrun_follower() -> bool:
    """One of torchrun's other processes (the first one serves the page and writes the files)."""
    return os.environ.get("RANK", "0") not in ("", "0")


@contextlib.contextmanager
def dashboard(args: argparse.Namespace, source: Callable[[], dict]) -> Iterator[None]:
    """Serve ``source`` on ``--dashboard`` for the ``with`` block (nothing without the flag)."""
    if not args.dashboard or _torchrun_follower():
        yield
        return
    from meshlearn.dashboard.server import DashboardServer, parse_listen

    host, port = parse_listen(args.dashboard)
    server = DashboardServer(source, host, port)
    url = server.start()
    print(f"dashboard: {url}", file=sys.stderr, flush=True)
    try:
        yield
    finally:
        server.stop()


@contextlib.contextmanager
def watch_run(args: argparse.Namespace, config: ExperimentConfig, sinks: list) -> Iterator[None]:
    """Feed ``sinks`` (and, with ``--tensorboard``, TensorBoard files) from ``config``'s run
    folder while the ``with`` block runs it."""
    from meshlearn.sim.live import RunWatch

    sinks = list(sinks)
    if args.tensorboard and not _torchrun_follower():
        from meshlearn.sim.tbsink import TensorBoardSink
        from meshlearn.tblog import run_folder

        sinks.append(TensorBoardSink(config, run_folder(args.tensorboard, Path(config.output).name)))
    if not sinks:
        yield
        return
    with RunWatch(Path(config.output) / "logs", sinks):
        yield
