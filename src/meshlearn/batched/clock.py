"""Modelled time: one virtual clock per node, advanced by a cost model instead of the wall clock.

The batched engine computes every node in one process, so the wall clock says nothing about how
long a node of a real deployment would take. Each node's clock advances by:

- **compute**: ``step_time`` per local SGD step (measured on one node alone, or configured),
  times the node's ``slowdown`` factor, plus its added seconds per step;
- **messages**: a model sent at time t arrives at ``t + latency + bytes / bandwidth``, the latency
  drawn per message from the run's ``net`` (normal(delay, jitter), clipped at 0) and, for TCP on a
  lossy path, plus the retransmission delay of ``netem.retransmit_delays`` (segments lost
  independently; a segment lost k > 1 times costs k - 1 doubling timeouts from 200 ms, Linux's
  RTO minimum: a lower-bound model, see docs/network-emulation.md). Each link carries its
  messages at the full bandwidth (a sender's links do not share an uplink).

A synchronous D-PSGD node waits until every neighbour's model of the iteration has arrived, or
for ``wait_timeout`` past the moment it was ready, as a process-engine node does.
"""

from __future__ import annotations

import numpy as np

from meshlearn.config import ExperimentConfig
from meshlearn.netem import retransmit_delays


class VirtualClocks:
    """Per-node modelled time (seconds since training started), for a run of ``config``.

    ``links_sender`` / ``links_receiver`` name the run's directed links (numpy arrays, one entry
    per link); ``message_bytes`` is what one model exchange sends over a link."""

    def __init__(self, config: ExperimentConfig, step_time: float, message_bytes: int,
                 links_sender: np.ndarray, links_receiver: np.ndarray):
        nodes = config.nodes
        slow = [config.slowdown_of(rank) for rank in range(nodes)]
        self.step_seconds = np.array([step_time * factor + extra for factor, extra in slow])
        self.now = np.zeros(nodes)
        self.net = config.net
        self.tcp_loss = config.net.loss if config.transport == "tcp" else 0.0
        self.wait_timeout = config.tcp.wait_timeout
        self.transfer = message_bytes * 8 / (config.batched.bandwidth_gbps * 1e9)
        self.message_bytes = message_bytes
        self.sender, self.receiver = links_sender, links_receiver
        self.rng = np.random.default_rng([config.seed, 0x71AE])  # its own stream: drawing times moves no data

    def train(self, rounds: int) -> np.ndarray:
        """Advance every clock by ``rounds`` local steps; returns each node's compute time."""
        spent = self.step_seconds * rounds
        self.now += spent
        return spent

    def latencies(self, count: int) -> np.ndarray:
        """Seconds from sending to having received, for ``count`` messages (one draw each)."""
        seconds = np.full(count, self.transfer)
        if self.net.delay or self.net.jitter:
            seconds += np.maximum(0.0, self.rng.normal(self.net.delay, self.net.jitter, count))
        if self.tcp_loss:
            seconds += retransmit_delays(self.tcp_loss, self.message_bytes, self.rng.random(count))
        return seconds

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node sends its model to its neighbours now and waits for theirs: advances the
        clocks; returns (arrived in time, per link; each node's waiting time)."""
        ready = self.now.copy()
        arrival = ready[self.sender] + self.latencies(len(self.sender))
        arrived = arrival <= ready[self.receiver] + self.wait_timeout
        last = ready.copy()
        np.maximum.at(last, self.receiver, np.where(arrived, arrival, -np.inf))
        missed = np.zeros(len(ready), dtype=bool)
        np.logical_or.at(missed, self.receiver, ~arrived)
        self.now = np.where(missed, ready + self.wait_timeout, last)
        return arrived, self.now - ready
