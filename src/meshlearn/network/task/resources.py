"""What a task needs of a provider and what a provider has: the requester's memory estimate, the
provider's check of what it declares against the machine (CloudMesh report 4.15.2, 4.18.2, 4.19.2).

The estimate is of a task's peak memory on one provider, in bytes:

- the Python and torch runtime every provider pays (``RUNTIME_BYTES``, measured: 0.24 GB of
  resident memory once torch and the task machinery are loaded, rounded up);
- the model's parameters, their gradients, SGD's momentum buffer (with momentum), two more
  flat copies the aggregation holds (one sent, one received), and an outer optimizer's state (the
  model before the round, and its momentum or moments);
- one batch's activations: every tensor the backward pass keeps of one sample's forward pass (a
  layer's inputs and outputs, a transformer's attention weights, B x heads x T x T), times the batch
  size, times two (kept, and their gradients);
- the provider's shard (the largest one) and the test set, as float32 tensors.
"""

from __future__ import annotations

import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from meshlearn.errors import UserInputError

GB = 2 ** 30
RUNTIME_BYTES = int(0.3 * GB)
AGGREGATION_COPIES = 2  # flat copies of the model the aggregation holds besides the model itself
MIN_RAM_GB = 2.0  # the least RAM worth declaring for ML: below it, a task's model and shard barely fit
DEVICE_ORDER = {"cuda": 0, "mps": 1, "cpu": 2}  # a provider's device, best first
MIN_CORES = 2  # the least cores worth declaring: with one, training and the provider's networking share it
MIN_DISK_GB = 1.0  # the least free disk a provider's work folder needs for tasks' shards and results


@dataclass(frozen=True)
class MemoryEstimate:
    """A task's estimated peak memory on one provider, by part, in bytes."""

    runtime: int
    model: int  # parameters, gradients, optimizer state, aggregation copies
    activations: int
    data: int  # the largest shard and the test set

    @property
    def total(self) -> int:
        return self.runtime + self.model + self.activations + self.data

    @property
    def gb(self) -> float:
        return self.total / GB

    def describe(self) -> str:
        """``about 0.35 GB (runtime 0.30, model 0.01, activations 0.00, data 0.04)``."""
        parts = ", ".join(f"{name} {value / GB:.2f}" for name, value in
                          (("runtime", self.runtime), ("model", self.model), ("activations", self.activations),
                           ("data", self.data)))
        return f"about {self.gb:.2f} GB ({parts})"


def estimate_memory(model, input_shape: tuple, batch_size: int, shard_samples: int, test_samples: int,
                    momentum: float, tokens: bool = False, outer_copies: int = 0) -> MemoryEstimate:
    """A task's peak memory on one provider (see the module's docstring for what is counted);
    ``tokens``: samples are windows of byte tokens (text), not float pixels; ``outer_copies``: the
    model-sized tensors an outer optimizer keeps (``OuterOptimizer.copies``)."""
    import torch

    from meshlearn.models.cost import saved_activation_bytes

    params = sum(p.numel() * p.element_size() for p in model.parameters())
    # weights, gradients, momentum, aggregation, the outer optimizer's state
    copies = 2 + (1 if momentum > 0 else 0) + AGGREGATION_COPIES + outer_copies
    saved = saved_activation_bytes(model, torch.zeros(1, *input_shape, dtype=torch.int64 if tokens else torch.float32))
    # float32 pixels and an int64 label, or a window of byte tokens and the next byte of each
    sample = 2 * math.prod(input_shape) if tokens else 4 * math.prod(input_shape) + 8
    return MemoryEstimate(runtime=RUNTIME_BYTES, model=copies * params, activations=2 * batch_size * saved,
                          data=sample * (shard_samples + test_samples))


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def machine_ram_gb() -> float:
    """This machine's physical memory in GB (0.0 if it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    except (ValueError, OSError, AttributeError):
        return 0.0


def check_declared(ram_gb: float | None, cores: int | None, workdir: Path) -> list[str]:
    """Check what a provider declares against this machine: more RAM or cores than it has, or a
    work folder with less than MIN_DISK_GB free, is refused (UserInputError, one line); less than
    MIN_RAM_GB or MIN_CORES gives a warning naming the consequence (returned)."""
    have_ram, have_cores = machine_ram_gb(), machine_cores()
    if ram_gb is not None and have_ram and ram_gb > have_ram + 0.01:
        raise UserInputError(f"--ram {ram_gb:g} is more than this machine has ({have_ram:.1f} GB): declare at most "
                             f"{have_ram:.1f}, or leave --ram out to declare what it has")
    if cores is not None and cores > have_cores:
        raise UserInputError(f"--cores {cores} is more than this machine has ({have_cores}): declare at most "
                             f"{have_cores}, or leave --cores out to declare them all")
    folder = workdir
    while not folder.exists() and folder != folder.parent:  # the work folder is made at start
        folder = folder.parent
    free = shutil.disk_usage(folder).free / GB
    if free < MIN_DISK_GB:
        raise UserInputError(f"--workdir {workdir} has {free:.2f} GB of free disk, less than the {MIN_DISK_GB:g} GB "
                             "a provider needs for tasks' shards and results: free some, or give another --workdir")
    warnings = []
    ram = ram_gb if ram_gb is not None else have_ram
    if ram and ram < MIN_RAM_GB:
        warnings.append(f"declaring {ram:g} GB of RAM, less than the {MIN_RAM_GB:g} GB minimum for ML: requesters "
                        "skip this provider for any task whose model, batch and shard need more, and it becomes "
                        "the bottleneck of those it takes")
    core_count = cores if cores is not None else have_cores
    if core_count < MIN_CORES:
        warnings.append(f"declaring {core_count} core(s), less than the {MIN_CORES} minimum for ML: training and "
                        "this provider's networking share one core, so its tasks train slower and it becomes the "
                        "bottleneck of the tasks it takes")
    return warnings


def wanted_device(device: str) -> str | None:
    """The device a request's ``--device`` names (gpu is cuda), or None for any."""
    return {"gpu": "cuda", "any": None}.get(device, device)
