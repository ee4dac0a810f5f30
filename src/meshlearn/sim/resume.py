"""Continuing an interrupted run from its checkpoints (``simulate --resume FOLDER``, and an
experiment's runs stopped half-way).

A run resumes with the configuration it started with (its ``config.yaml``), from the newest
checkpoint every writer finished (the batched engine's one, or every node's of the process
engine, which restart together). Everything is checked before anything is touched: the folder,
its configuration, each checkpoint's checksum and configuration; a bad one is one line, and the
folder is left as it was.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import yaml

from meshlearn.checkpoint import FOLDER, CheckpointStore, RunCheckpoints
from meshlearn.config import ExperimentConfig, make_config
from meshlearn.definitions.base import definition
from meshlearn.errors import CheckpointError, ConfigError
from meshlearn.node.factory import checkpoint_name
from meshlearn.plugins import load_folder_module
from meshlearn.sim.runfolder import run_config


def writers(config: ExperimentConfig) -> list[str]:
    """The names a run's checkpoints are written under: the batched engine's one, or a node's each."""
    return ["nodes"] if config.engine == "batched" else [checkpoint_name(rank) for rank in range(config.nodes)]


def saved_config(folder: str | Path, models_module: str | Path | None = None) -> ExperimentConfig:
    """The configuration a results folder's run started with; CheckpointError if it holds none. A
    run whose config names a models module is read only where ``models_module`` (the user's
    ``--models-module``) is that file, which it then loads (``plugins.load_folder_module``)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder: give the results folder of the run to resume")
    values = run_config(folder)
    if not values:
        raise CheckpointError(f"{folder} holds no run (no readable config.yaml): give the results folder of the "
                              "run to resume")
    try:
        config = make_config({**values, "output": str(folder)})
    except ConfigError as exc:
        raise CheckpointError(f"{folder}/config.yaml is not a configuration this version runs: {exc}") from None
    load_folder_module(folder / "config.yaml", config.models_module, models_module)
    return config


def with_changes(config: ExperimentConfig, changes: dict[str, Any]) -> ExperimentConfig:
    """``config`` if ``changes`` (settings given beside ``--resume``) leave it as it is; else
    CheckpointError naming what they change (a run resumes only with its own configuration)."""
    if not changes:
        return config
    changed = make_config({**config.model_dump(), **changes, "output": config.output})
    if changed.fingerprint() == config.fingerprint():
        return config
    before, after = yaml.safe_load(config.to_yaml()), yaml.safe_load(changed.to_yaml())
    names = sorted(name for name in after if after[name] != before.get(name))
    raise CheckpointError(f"--resume continues a run with its own settings; these differ from it: {', '.join(names)} "
                          "(leave them out, or start a new run)")


def finished(folder: Path) -> bool:
    """Whether ``folder``'s run finished (its summary written after its last log line)."""
    summary, logs = folder / "summary.json", list((folder / "logs").glob("*.jsonl"))
    return summary.is_file() and bool(logs) and max(f.stat().st_mtime for f in logs) <= summary.stat().st_mtime


def resume_point(config: ExperimentConfig) -> int | list[int]:
    """The iteration the run in ``config.output`` resumes from: its newest checkpoint every writer
    finished; for the process engine's asynchronous algorithms (gossip, the leader), whose nodes
    run at their own pace, each node's own newest (a list, by rank). Each one is checked
    (checksum, configuration, format); CheckpointError, in one line, where there is none or one is bad."""
    folder = Path(config.output)
    if finished(folder):
        raise CheckpointError(f"{folder} holds a finished run (its summary.json is newer than its logs): nothing "
                              "to resume")
    if config.engine == "batched" and not definition(config.algorithm).needs.synchronous:
        raise CheckpointError(f"a batched {config.algorithm} run keeps no checkpoints (its nodes are asynchronous): "
                              "run it again, or on the process engine")
    store = CheckpointStore(folder / FOLDER)
    if not store.iterations():
        every = config.checkpoint_interval
        why = "it keeps none (checkpoint_every 0)" if not every else \
            f"it stopped before its first, at iteration {every}"
        raise CheckpointError(f"{folder} holds no checkpoint: {why}; start the run again")
    names = writers(config)
    if config.engine == "process" and not definition(config.algorithm).needs.synchronous:
        iterations = store.iterations()
        each = [max((i for i in iterations if store.has(i, name)), default=None) for name in names]
        if None in each:
            raise CheckpointError(f"{folder / FOLDER} holds no checkpoint of node {each.index(None)}: start the run "
                                  "again")
        for name, iteration in zip(names, each):
            RunCheckpoints(folder, name, config.fingerprint()).load(iteration)  # raises for a bad one
        return each[0] if len(set(each)) == 1 else each
    iteration = store.latest(names)
    if iteration is None:
        raise CheckpointError(f"{folder / FOLDER} holds no checkpoint that every one of the {len(names)} "
                              f"{'process' if len(names) == 1 else 'nodes'} finished: start the run again")
    for name in names:
        RunCheckpoints(folder, name, config.fingerprint()).load(iteration)  # raises for a bad one
    return iteration


def resumable(config: ExperimentConfig, say: Callable[[str], None]) -> int | list[int] | None:
    """The iteration an experiment's run in ``config.output`` goes on from, or None to start it
    afresh: none there, or one that cannot be used (``say`` hears why, and the run starts over)."""
    folder = Path(config.output)
    if not CheckpointStore(folder / FOLDER).iterations() or finished(folder):
        return None
    try:
        return resume_point(config)
    except CheckpointError as exc:
        say(f"started again: its checkpoint cannot be used ({exc})")
        return None
