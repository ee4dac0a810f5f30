"""How a batched run is set up on this machine: whether its nodes train in vectorized calls and in
blocks of how many, on how many worker threads, and the modelled seconds of one local step (one
place for every path of the engine, the cohort's too)."""

from __future__ import annotations

import copy
import time

import numpy as np
import torch
from torch import nn

from meshlearn.batched.models import has_convolutions
from meshlearn.batched.workers import WorkerChoice, available_cores
from meshlearn.config import ExperimentConfig, load_run_dataset
from meshlearn.data import Dataset, require_materialized, split_validation
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.models.cost import saved_activation_bytes, step_flops
from meshlearn.optim import optimizer_of
from meshlearn.plugins import load_user_module
from meshlearn.sgd import local_step
from meshlearn.tasks import task_of

MEASURED_STEPS = 5
# bytes of activations (``saved_activation_bytes`` x the batch) one vectorized training call may keep
# on the CPU: vmap's gradient peaks at about 3 times that (gpt-tiny on 32 windows of 64 tokens: 75 MB,
# 240 MB a node at the peak), and blocks of more nodes were no faster (docs/batched-engine.md)


ACTIVATIONS_PER_CALL = 128 * 2 ** 20


def vectorize(config: ExperimentConfig, model: nn.Module) -> bool:
    """Whether the run trains its nodes in vectorized calls (``batched_vectorize``; auto: yes,
    except for a model with convolutions on the CPU)."""
    choice = config.batched.vectorize
    if choice != "auto":
        return choice == "on"
    return not (config.device == "cpu" and has_convolutions(model))


def training_chunk(config: ExperimentConfig, model: nn.Module, sample: torch.Tensor) -> int:
    """Nodes per vectorized call (``batched_chunk``; 0 = auto: on the CPU, as many as keep a call's
    activations within ACTIVATIONS_PER_CALL, at least one; on a GPU, all) for ``model`` on inputs
    like ``sample`` (one, as the model reads it). The block size never changes a node's result, as
    the worker count does not."""
    if config.batched.chunk or config.device != "cpu":
        return config.batched.chunk
    per_node = config.batch_size * saved_activation_bytes(model, sample.unsqueeze(0))
    return max(1, ACTIVATIONS_PER_CALL // max(1, per_node))


def worker_counts(config: ExperimentConfig) -> tuple[int, WorkerChoice]:
    """How many worker threads may train the nodes, and how the count for each step is chosen
    (``batched_workers``; auto: one, or one per available core, whichever the first steps find faster;
    one on a GPU, which is one device whatever the threads)."""
    if config.batched.workers:
        return config.batched.workers, WorkerChoice([config.batched.workers])
    cores = 1 if config.device != "cpu" else available_cores()
    return cores, WorkerChoice([1, cores])


def modelled_step_time(model: nn.Module, dataset: Dataset, indices: np.ndarray, config: ExperimentConfig) -> float:
    """Modelled seconds of one node's local SGD step: ``step_time`` where configured; else, by
    ``step_cost``, the model's counted FLOPs per step over ``device_gflops`` plus ``step_overhead``
    (the default: the same for a config on any machine, under any load), or ``measure_step_time``."""
    settings = config.batched
    if settings.step_time:
        return settings.step_time
    if settings.step_cost == "measured":
        return measure_step_time(model, dataset, indices, config)
    flops = step_flops(model, dataset.normalize(dataset.train_x[:1])[0], config.batch_size)
    return flops / (settings.device_gflops * 1e9) + settings.step_overhead


def measure_step_time(model: nn.Module, dataset: Dataset, indices: np.ndarray, config: ExperimentConfig) -> float:
    """Seconds of one node's local SGD step, alone (the fastest of a few, after a warm-up: other
    load on the machine only ever adds): the modelled compute time of a step. Leaves torch's
    random state as it was."""
    device = torch.device(config.device)
    with torch.random.fork_rng(devices=[]):
        alone = copy.deepcopy(model).to(device)
        flat = FlatState(alone)
        optimizer = optimizer_of(config, flat.params.unsqueeze(0))
        parameters = list(alone.parameters())
        batch = torch.from_numpy(np.array(indices[:config.batch_size], dtype=np.int64))  # (a Partition's parts are read-only)
        x, y = dataset.normalize(dataset.train_x[batch]).to(device), dataset.train_y[batch].to(device)
        times = []
        for _ in range(MEASURED_STEPS + 1):
            start = time.perf_counter()
            local_step(alone, parameters, optimizer, x, y, task_of(dataset).loss)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return min(times[1:])


def batches_per_epoch(sizes: np.ndarray, batch_size: int) -> int:
    """The mini-batches in one pass over a shard of each of ``sizes`` samples, the same for every
    node; ConfigError if not (every node of the batched engine takes its steps with all the others)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    counts = np.unique(-(-sizes // np.minimum(batch_size, sizes)))
    if len(counts) > 1:
        raise ConfigError(f"full_epochs on the batched engine needs every shard to make as many batches of "
                          f"{batch_size}; these make {counts[0]} to {counts[-1]}: use the process engine, or a batch "
                          "size that divides the shards alike")
    return int(counts[0])


def run_data(config: ExperimentConfig, whole: bool = True) -> tuple[Dataset, Dataset | None]:
    """A run's data, as every batched path loads it: the user's module loaded first (it may register
    the dataset), the dataset (a generated population ``whole``, which a row per node needs: refused in
    one line where too large to hold; else only the users a sample needs), and the validation set
    held out of it (None without one)."""
    if config.models_module:
        load_user_module(config.models_module)
    dataset = load_run_dataset(config, whole=whole)
    if whole:
        require_materialized(dataset)
    return split_validation(dataset, config.validation, config.seed)
