"""Simulation: run many nodes on one machine and report on the run.

Names are imported on first use: ``sim.checks`` looks at a config before torch loads."""

from meshlearn.lazy import lazy_exports

_WHERE = {
    **{name: "launcher" for name in ("NodeFailure", "SimulationResult", "prepare_run")},
    "simulate": "run",  # run(config) under its public name: it picks the engine
    "format_summary": "summary",
    "write_report": "report",
    "check_before_start": "checks",
}
__all__ = sorted(_WHERE)

__getattr__ = lazy_exports(__name__, _WHERE)
