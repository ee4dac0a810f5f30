"""The batched engine's modelled network, with a process transport's face: whether it is lossy,
gathers over links in modelled time, and counters. An algorithm gathers over it; the network
advances the clocks, draws lost chunks and counts the traffic, as a process-engine transport
counts its own, so no batched algorithm counts bytes or reads the transport's name."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from meshlearn.batched.clock import VirtualClocks
from meshlearn.batched.loss import ChunkLoss
from meshlearn.checkpoint import CheckpointError, Stateful
from meshlearn.config import ExperimentConfig
from meshlearn.transport.settings import default_chunk_bytes


@dataclass
class Traffic(Stateful):
    """Per-node counters of what the modelled network carried (the process engine's names)."""

    state_fields = ("counters",)

    nodes: int
    counters: dict[str, np.ndarray] = field(default_factory=dict)

    NAMES: ClassVar[tuple[str, ...]] = ("messages_sent", "bytes_sent", "messages_received", "bytes_received",
                                        "gather_timeouts", "stale_dropped", "malformed_dropped", "chunks_lost")

    def __post_init__(self) -> None:
        for name in self.NAMES:
            self.counters.setdefault(name, np.zeros(self.nodes, dtype=np.int64))

    def add(self, name: str, values: Any) -> None:
        """Add one value per node."""
        self.counters[name] += np.asarray(values, dtype=np.int64)

    def add_one(self, name: str, rank: int, value: int) -> None:
        """Add ``value`` to node ``rank``'s counter ``name``."""
        self.counters[name][rank] += value

    def sent(self, rank: int, nbytes: int = 0) -> None:
        """Node ``rank`` sent one message carrying ``nbytes`` of state (0: a request)."""
        self.counters["messages_sent"][rank] += 1
        self.counters["bytes_sent"][rank] += nbytes

    def received(self, rank: int, nbytes: int = 0) -> None:
        """Node ``rank`` received one message carrying ``nbytes`` of state (0: a request)."""
        self.counters["messages_received"][rank] += 1
        self.counters["bytes_received"][rank] += nbytes

    def of(self, rank: int) -> dict[str, int]:
        """Node ``rank``'s counters, as a process-engine node reports its transport's stats."""
        return {name: int(values[rank]) for name, values in self.counters.items()}


class ModelledNetwork(Stateful):
    """Gathers over directed links (numpy arrays of senders and receivers, one entry per link)
    in modelled time, counting what each node sent and received in ``traffic``. ``lossy`` (UDP):
    messages travel as chunks of ``chunk_bytes``, each of which may be lost or late."""

    def __init__(self, config: ExperimentConfig, clocks: VirtualClocks, traffic: Traffic):
        self.clocks = clocks
        self.traffic = traffic
        self.lossy = config.transport == "udp"
        self.chunk_bytes = (config.udp.chunk_bytes or default_chunk_bytes(config.host)) if self.lossy else 0
        self.waits = config.udp.mode == "sync"  # UDP's async mode: nobody waits, nobody times out
        self.net, self.seed = config.net, config.seed
        self._loss: ChunkLoss | None = None

    def state_dict(self) -> dict[str, Any]:
        """The chunk-loss chains, once drawn (a checkpoint's)."""
        return {"loss": None if self._loss is None else self._loss.state_dict()}

    def load_state(self, state: dict[str, Any], device: str = "cpu") -> None:
        saved = state.get("loss") if isinstance(state, dict) else None
        if saved is None:
            self._loss = None
            return
        dropped = saved.get("dropped", {}) if isinstance(saved, dict) else {}
        links = dropped.get("$array") if isinstance(dropped, dict) else None
        if links is None or not isinstance(saved.get("chunks"), int):
            raise CheckpointError("the checkpoint's chunk-loss chains are damaged")
        self._loss = ChunkLoss(self.net, len(links), saved["chunks"], np.random.default_rng())
        self._loss.load_state(saved, device)

    def gather(self, sender: np.ndarray, receiver: np.ndarray,
               silent: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Every sender sends its message over its links now and every receiver waits for its own
        (TCP: whole messages, late ones left out; ``silent`` links send nothing, and nobody waits
        for them): (arrived in time, per link; each node's waiting time)."""
        self.clocks.sender, self.clocks.receiver = sender, receiver
        arrived, waited = self.clocks.gather()
        silent = np.zeros(len(sender), dtype=bool) if silent is None else silent
        arrived = arrived & ~silent
        self.count(sender, receiver, arrived, arrived | silent)
        return arrived, waited

    def gather_chunks(self, sender: np.ndarray, receiver: np.ndarray, chunks: int,
                      silent: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """As ``gather`` over a lossy network: messages of ``chunks`` chunks, each lost (the
        emulated ``net``) or late on its own: (chunks in time, [links, chunks]; each node's waiting
        time; chunks each node lost)."""
        if self._loss is None:  # every process draws every link's mask (the same draws), and uses its own
            self._loss = ChunkLoss(self.net, len(sender), chunks, np.random.default_rng([self.seed, 0x1055]))
        self.clocks.sender, self.clocks.receiver = sender, receiver
        in_time, waited = self.clocks.gather_chunks(self._loss.draw(), wait=self.waits)
        in_time = in_time & ~silent[:, None]
        lost = np.bincount(receiver, weights=(~in_time).sum(1) * ~silent,
                           minlength=self.traffic.nodes).astype(np.int64)
        self.traffic.add("chunks_lost", lost)
        self.count(sender, receiver, in_time.any(1), in_time.all(1) | silent | (not self.waits))
        return in_time, waited, lost

    def count(self, sender: np.ndarray, receiver: np.ndarray, arrived: np.ndarray,
              complete: np.ndarray | None = None) -> np.ndarray:
        """Count one message per link sent, those ``arrived`` received, and a gather timeout for
        each receiver with a link not ``complete`` (default: not arrived); returns the messages
        each node received."""
        nodes, size = self.traffic.nodes, self.clocks.message_bytes
        sent = np.bincount(sender, minlength=nodes).astype(np.int64)
        received = np.bincount(receiver, weights=arrived, minlength=nodes).astype(np.int64)
        complete = arrived if complete is None else complete
        self.traffic.add("messages_sent", sent)
        self.traffic.add("bytes_sent", sent * size)
        self.traffic.add("messages_received", received)
        self.traffic.add("bytes_received", received * size)
        self.traffic.add("gather_timeouts", np.bincount(receiver, weights=~complete, minlength=nodes) > 0)
        return received

    def carry(self, message_bytes: int) -> None:
        """Messages of ``message_bytes`` from now on."""
        self.clocks.resize(message_bytes)
