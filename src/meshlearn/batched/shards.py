"""Beyond one process: the batched engine's nodes split over processes with torch.distributed.

Started with ``torchrun`` (which sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous),
every process holds a contiguous block of the nodes (a ``Shard``) and the same everything else
(graph, clocks, loss masks: their random draws are the same in every process). What crosses
processes (``Collective``): the rows a block's D-PSGD average needs from other blocks (batched
point-to-point), the log's columns and evaluations (gathered to the first process, which alone
writes files), and sums for the consensus distance. One process: no process group, nothing sent.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Shard:
    """The nodes this process holds: global ranks ``start .. stop - 1`` of ``nodes``; it is process
    ``index`` of ``count``."""

    index: int
    count: int
    start: int
    stop: int
    nodes: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files (the first one)."""
        return self.index == 0

    @property
    def ranks(self) -> list[int]:
        return list(range(self.start, self.stop))


def blocks(nodes: int, count: int) -> list[tuple[int, int]]:
    """The (start, stop) of each process's block: contiguous, sizes differing by at most one."""
    bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(nodes), count)])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def launched_processes() -> int:
    """How many processes ``torchrun`` started for this run (1 without it)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def join(device: str) -> tuple[int, int, str]:
    """Join the run's process group if ``torchrun`` started several processes (gloo on the CPU,
    NCCL on GPUs, each process on its own GPU); returns (index, count, this process's device)."""
    count = launched_processes()
    if count == 1:
        return 0, 1, device
    if not dist.is_initialized():
        cuda = device.startswith("cuda")
        if cuda and device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        if cuda:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if cuda else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def leave() -> None:
    """Leave the process group (if this process joined one)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


class Collective:
    """What the processes of a run exchange; with one process every call is local."""

    def __init__(self, shard: Shard):
        self.shard = shard
        self.spread = shard.count > 1

    def barrier(self) -> None:
        if self.spread:
            dist.barrier()

    def broadcast(self, value: Any) -> Any:
        """The first process's ``value``, in every process."""
        if not self.spread:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, values: list[Any]) -> list[Any] | None:
        """Every process's ``values`` (one per node it holds, in rank order) joined in rank order,
        on the first process; None on the others."""
        if not self.spread:
            return list(values)
        parts = [None] * self.shard.count if self.shard.main else None
        dist.gather_object(list(values), parts, dst=0)
        return [value for part in parts for value in part] if self.shard.main else None

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the processes, in place."""
        if self.spread:
            dist.all_reduce(tensor)
        return tensor

    def exchange(self, rows: torch.Tensor, plan: "HaloPlan") -> torch.Tensor:
        """The rows of other blocks this block needs (``plan.receive``), in the plan's order,
        sending ours that they need (``plan.send``): one batch of point-to-point messages."""
        if not self.spread:
            return rows[:0]
        received = [torch.empty(len(index), rows.shape[1], dtype=rows.dtype, device=rows.device)
                    for index in plan.receive.values()]
        ops = [dist.P2POp(dist.isend, rows[index].contiguous(), peer) for peer, index in plan.send.items()]
        ops += [dist.P2POp(dist.irecv, buffer, peer) for peer, buffer in zip(plan.receive, received)]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return torch.cat(received) if received else rows[:0]


@dataclass
class HaloPlan:
    """Which rows cross between blocks for one block's average: ``send[p]`` local indices of our
    rows process p needs, ``receive[p]`` how many (and which global ranks) we get from p, in the
    order they follow our own rows in the extended state."""

    send: dict[int, torch.Tensor]
    receive: dict[int, list[int]]

    def extended_index(self, shard: Shard) -> dict[int, int]:
        """Global rank -> row of the extended state (our rows first, then received ones)."""
        index = {rank: rank - shard.start for rank in shard.ranks}
        for ranks in self.receive.values():
            for rank in ranks:
                index[rank] = len(index)
        return index


def halo_plan(sender: np.ndarray, receiver: np.ndarray, shard: Shard, device: torch.device | str) -> HaloPlan:
    """The plan for ``shard`` over the run's directed links (global ``sender`` -> ``receiver``)."""
    owner = np.zeros(shard.nodes, dtype=np.int64)
    for process, (start, stop) in enumerate(blocks(shard.nodes, shard.count)):
        owner[start:stop] = process
    send, receive = {}, {}
    for process in range(shard.count):
        if process == shard.index:
            continue
        theirs = owner[receiver] == process
        ours = owner[sender] == shard.index
        needed = np.unique(sender[theirs & ours])  # our rows their nodes average with
        if len(needed):
            send[process] = torch.as_tensor(needed - shard.start, device=device)
        wanted = np.unique(sender[(owner[receiver] == shard.index) & (owner[sender] == process)])
        if len(wanted):
            receive[process] = [int(rank) for rank in wanted]
    return HaloPlan(send, receive)
