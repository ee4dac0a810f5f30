"""Simulation: run many nodes on one machine and report on the run."""

from meshlearn.sim.launcher import NodeFailure, SimulationResult, prepare_run, simulate
from meshlearn.sim.report import format_summary, write_report

__all__ = ["NodeFailure", "SimulationResult", "format_summary", "prepare_run", "simulate", "write_report"]
