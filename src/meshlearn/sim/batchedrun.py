"""A simulation on the batched engine: every node in this process (``engine: batched``), or, under
``torchrun``, the nodes split over its processes (the first one writes the results folder)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from meshlearn.config import ExperimentConfig
from meshlearn.sim.checks import check_before_start
from meshlearn.sim.report import write_launched_report


def simulate_batched(config: ExperimentConfig, progress: bool, say: Callable[[str], None],
                     prepare: Callable[[ExperimentConfig], tuple[Any, Path]],
                     launched: float, resume: int | None = None) -> tuple[Path, dict[int, dict[str, Any]], bool]:
    """Run ``config`` on the batched engine; (results folder, the nodes' summaries, whether this
    process is the one that wrote them). ``prepare`` checks the run and makes its folder;
    ``resume``: continue from the run's checkpoint of that iteration."""
    from tqdm import tqdm

    from meshlearn.batched.engine import BatchedSimulation
    from meshlearn.batched.shards import Collective, Shard, blocks, join, leave

    index, count, device = join(config.device)
    try:
        config = config.model_copy(update={"device": device})
        shard = Shard(index, count, *blocks(config.nodes, count)[index], config.nodes)
        collective = Collective(shard)
        if shard.main:
            graph, output = prepare(config)
            where = f" of {count} processes" if count > 1 else ""
            say(f"training {config.nodes} nodes in this process{where} (batched engine; times are modelled)")
        else:
            graph, output = check_before_start(config), None
        output = Path(collective.broadcast(str(output)))
        with tqdm(total=config.iterations, initial=resume or 0, desc="iterations", unit="it", disable=not (progress and shard.main),
                  file=sys.stderr) as bar:
            simulation = BatchedSimulation(config, graph, output / "logs", shard=shard,
                                           progress=lambda done: bar.update(done - bar.n), resume=resume)
            summaries = simulation.run()
        if shard.main:
            if not config.batched.step_time and config.batched.step_cost == "measured":  # rerun as measured
                measured = config.batched.model_copy(update={"step_time": simulation.step_time})
                (output / "config.yaml").write_text(
                    config.model_copy(update={"output": str(output), "batched": measured}).to_yaml())
            write_launched_report(output, launched, config.models_module)  # the run its user named
        collective.barrier()  # nobody leaves before the results are written
        return output, summaries, shard.main
    finally:
        leave()
