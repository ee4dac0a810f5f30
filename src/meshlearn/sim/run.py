"""One entry for a local run: ``run(config)`` picks the engine that runs it.

- ``engine: batched``: every node in this process (or torchrun's), the network modelled
  (``sim.batchedrun``);
- the process engine in a lossy network namespace, where the run's loss is made by the kernel
  (``sim.kernelnet``: a child process in the namespace runs the process engine);
- the process engine on this machine's network as it is (``sim.launcher``).

This module sits above the engines: it imports them, and none of them imports it (or each other),
so the modules of ``meshlearn.sim`` import one another without a cycle.
"""

from __future__ import annotations

import json
import time

from meshlearn.config import ExperimentConfig
from meshlearn.errors import CheckpointError
from meshlearn.sim.launcher import Say, SimulationResult, default_output, default_say, prepare_run, run_processes


def run(config: ExperimentConfig, progress: bool = True, say: Say | None = None,
        launched: float | None = None, resume: int | list[int] | None = None) -> SimulationResult:
    """Run a whole experiment on the engine ``config`` asks for; write its results folder.

    ``say`` hears what start-up is doing (default: stderr with progress, nothing without).
    ``launched``: when the run began, as ``time.time()`` (the command line gives its process's
    start, so the wall-clock it reports counts its own start-up too; default: now). ``resume``:
    continue the run in ``config.output`` from its checkpoint of that iteration, or of these, one
    per rank (``sim.resume`` finds them and checks them first)."""
    from meshlearn.sim.kernelnet import needs_namespace, resolve_loss_mode, run_in_namespace

    launched = time.time() if launched is None else launched
    say = say or default_say(progress)
    if config.engine == "batched":  # every node in this process (or torchrun's); the network is modelled
        from meshlearn.sim.batchedrun import simulate_batched

        output, summaries, main = simulate_batched(config, progress, say,
                                                   lambda c: prepare_run(c, say=say, resume=resume), launched, resume)
        return SimulationResult(output, summaries, main)
    config = resolve_loss_mode(config)
    if needs_namespace(config):
        if resume is not None:
            raise CheckpointError("a run whose loss the kernel makes (loss_mode kernel) cannot be resumed yet: run "
                                  "it again, or with loss_mode user")
        if not config.output:
            config = config.model_copy(update={"output": str(default_output())})
        output = run_in_namespace(config, progress, run_processes)
        per_node = json.loads((output / "summary.json").read_text())["per_node"]
        return SimulationResult(output, {int(rank): summary for rank, summary in per_node.items()})
    return run_processes(config, progress, say, launched, resume)


simulate = run  # the public name (meshlearn.sim.simulate) every caller knows
