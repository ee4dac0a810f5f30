"""The batched engine's modelled network, with a process transport's face: an algorithm gathers
over it and it advances the clocks and counts the traffic, as a process-engine transport counts
its own, so no batched algorithm counts bytes itself."""

from __future__ import annotations

import numpy as np

from meshlearn.batched.algorithms.base import Traffic
from meshlearn.batched.clock import VirtualClocks


class ModelledNetwork:
    """Gathers over directed links (numpy arrays of senders and receivers, one entry per link)
    in modelled time, counting what each node sent and received in ``traffic``."""

    def __init__(self, clocks: VirtualClocks, traffic: Traffic):
        self.clocks = clocks
        self.traffic = traffic

    def gather(self, sender: np.ndarray, receiver: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every sender sends its message over its links now and every receiver waits for its own
        (TCP: whole messages, late ones left out): (arrived in time, per link; each node's waiting
        time)."""
        self.clocks.sender, self.clocks.receiver = sender, receiver
        arrived, waited = self.clocks.gather()
        self.count(sender, receiver, arrived)
        return arrived, waited

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
