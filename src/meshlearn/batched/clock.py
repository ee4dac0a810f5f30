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
  messages at the full bandwidth (a sender's links do not share an uplink): ``net``'s ``rate``
  where given, else ``bandwidth_gbps``.

A synchronous D-PSGD node waits until every neighbour's model of the iteration has arrived, or
for ``wait_timeout`` past the moment it was ready, as a process-engine node does. Over UDP (sync)
every chunk travels on its own (its own latency draw) and may be lost (``batched.loss``); a node
waits until every chunk is in, or for the UDP ``timeout``: chunks later than that count as lost
(the process engine's ``late_chunks: use`` would keep them for the next iteration; not modelled).
In UDP's async mode nobody waits: a node averages the chunks of the iteration that have arrived
when it is ready (the UDP transport's async take: the newest message so far, older ones dropped).
"""

from __future__ import annotations

import numpy as np

from meshlearn.checkpoint import Stateful
from meshlearn.config import ExperimentConfig
from meshlearn.netem import retransmit_delays


class VirtualClocks(Stateful):
    """Per-node modelled time (seconds since training started), for a run of ``config``.

    ``links_sender`` / ``links_receiver`` name the run's directed links (numpy arrays, one entry
    per link); ``message_bytes`` is what one model exchange sends over a link."""

    state_fields = ("now", "rng", "transfer", "message_bytes", "step_seconds")  # a measured step time too

    def __init__(self, config: ExperimentConfig, step_time: float, message_bytes: int,
                 links_sender: np.ndarray, links_receiver: np.ndarray):
        nodes = config.nodes
        factors, extras = config.slowdowns(nodes)
        self.step_seconds = step_time * np.array(factors) + np.array(extras)
        self.now = np.zeros(nodes)
        self.net = config.net
        self.tcp_loss = config.net.loss if config.transport == "tcp" else 0.0
        self.wait_timeout = config.udp.timeout if config.transport == "udp" else config.tcp.wait_timeout
        # each link's bandwidth: the emulated one (``net: rate=...``, as the process engine's
        # transports apply it) where given, else the modelled ``bandwidth_gbps``
        self.bandwidth_gbps = config.net.rate / 1e9 if config.net.rate else config.batched.bandwidth_gbps
        self.resize(message_bytes)
        self.sender, self.receiver = links_sender, links_receiver
        self.rng = np.random.default_rng([config.seed, 0x71AE])  # its own stream: drawing times moves no data

    def resize(self, message_bytes: int) -> None:
        """Messages of ``message_bytes`` from now on (an algorithm that sends more than a model)."""
        self.transfer = message_bytes * 8 / (self.bandwidth_gbps * 1e9)
        self.message_bytes = message_bytes

    def train(self, rounds: int, ranks: list[int] | None = None) -> np.ndarray:
        """Advance every clock (or those of ``ranks``, the others idle) by ``rounds`` local steps;
        returns each node's compute time."""
        spent = self.step_seconds * rounds
        if ranks is not None:
            spent = np.where(np.isin(np.arange(len(spent)), ranks), spent, 0.0)
        self.now += spent
        return spent

    def latencies(self, shape: int | tuple[int, ...], tcp: bool = True) -> np.ndarray:
        """Seconds from sending to having received, one draw per message (or chunk) of ``shape``."""
        seconds = np.full(shape, self.transfer)
        if self.net.delay or self.net.jitter:
            seconds += np.maximum(0.0, self.rng.normal(self.net.delay, self.net.jitter, shape))
        if tcp and self.tcp_loss:
            seconds += retransmit_delays(self.tcp_loss, self.message_bytes, self.rng.random(shape))
        return seconds

    def gather(self) -> tuple[np.ndarray, np.ndarray]:
        """Every node sends its model to its neighbours now and waits for theirs (TCP: whole
        models, never lost, maybe late): advances the clocks; returns (arrived in time, per link;
        each node's waiting time)."""
        ready = self.now.copy()
        arrival = ready[self.sender] + self.latencies(len(self.sender))
        arrived = arrival <= ready[self.receiver] + self.wait_timeout
        return arrived, self._wait(ready, arrival, arrived)

    def gather_chunks(self, arrives: np.ndarray, wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """As ``gather``, over UDP: ``arrives`` [links, chunks] says which chunks the network
        delivers at all; returns (chunks in time, [links, chunks]; each node's waiting time).
        Without ``wait`` (UDP's async mode) nobody waits: what has arrived when a node is ready is
        what it averages, and the rest of that iteration's chunks come too late for it."""
        ready = self.now.copy()
        arrival = ready[self.sender][:, None] + self.latencies(arrives.shape, tcp=False)
        deadline = ready[self.receiver] + (self.wait_timeout if wait else 0.0)
        in_time = arrives & (arrival <= deadline[:, None])
        if not wait:
            return in_time, np.zeros(len(ready))
        return in_time, self._wait(ready, np.where(in_time, arrival, -np.inf).max(1), in_time.all(1))

    def _wait(self, ready: np.ndarray, arrival: np.ndarray, complete: np.ndarray) -> np.ndarray:
        """Advance each node to when its last neighbour's message was in (``arrival`` per link),
        or to its timeout if any link was not ``complete``; returns the waiting times."""
        last = ready.copy()
        np.maximum.at(last, self.receiver, np.where(complete, arrival, -np.inf))
        missed = np.zeros(len(ready), dtype=bool)
        np.logical_or.at(missed, self.receiver, ~complete)
        self.now = np.where(missed, ready + self.wait_timeout, last)
        return self.now - ready
