"""A simulation on the batched engine: every node in this process (``engine: batched``)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from meshlearn.config import ExperimentConfig
from meshlearn.sim.report import RUN_TIMES
from meshlearn.topology import Graph


def run_batched(config: ExperimentConfig, graph: Graph, output: Path, progress: bool, say: Callable[[str], None],
                launched: float) -> dict[int, dict[str, Any]]:
    """Train the run's nodes together (``meshlearn.batched``), log into ``output``; the nodes' summaries."""
    from tqdm import tqdm

    from meshlearn.batched import BatchedSimulation

    say(f"training {config.nodes} nodes in this process (batched engine; times are modelled)")
    with tqdm(total=config.iterations, desc="iterations", unit="it", disable=not progress, file=sys.stderr) as bar:
        simulation = BatchedSimulation(config, graph, output / "logs", progress=lambda done: bar.update(done - bar.n))
        summaries = simulation.run()
    (output / RUN_TIMES).write_text(json.dumps({"launched": launched, "finished": time.time()}))
    return summaries
