"""A drop-in PyTorch adapter: asynchronous peer-to-peer averaging around any training loop.

    adapter = GossipAdapter(model, "w1", "gossip.yaml")   # dpwa's config format works unchanged
    for x, y in batches:
        adapter.update_send(loss)    # maybe start fetching a peer's model
        loss = train_batch(x, y)
        adapter.update_wait(loss)    # publish the trained model; wait for that fetch (<= timeout_ms); interpolate
    adapter.close()

``DpwaPyTorchAdapter`` is the same class under dpwa's name. Nothing received is unpickled: states
travel in meshlearn's wire format (see ``meshlearn.transport.pull``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from meshlearn.adapter.config import GossipConfig, PeerAddress, load_gossip_config
from meshlearn.algorithms.gossip import GossipAverager
from meshlearn.flat import FlatState
from meshlearn.transport.pull import PullEndpoint


class GossipAdapter:
    """Wraps one worker's ``nn.Module``: its parameters (and float buffers) are averaged with the
    other workers' of the config by gossip while the worker trains as usual.

    The constructor only reads the config and flattens the model's state in place (optimizers
    built before or after keep working). The endpoint starts on the first ``update_send`` (or
    ``start()``); ``close()`` (or leaving a ``with`` block) stops it.
    """

    def __init__(self, model: nn.Module, name: str, config: str | Path | dict | list | GossipConfig,
                 seed: int | None = None):
        self.config = load_gossip_config(config)
        self.name = name
        self.rank = self.config.rank_of(name)
        self.model = model
        self.flat = FlatState(model)
        me = self.config.nodes[self.rank]
        self.endpoint = PullEndpoint(self.rank, _ip(me.host), me.port)
        peers = [rank for rank in range(len(self.config.nodes)) if rank != self.rank]
        self.averager = GossipAverager(self.flat, self.endpoint, peers, self.config.settings(),
                                       seed=self.rank if seed is None else seed)
        self._started = False

    def start(self) -> None:
        """Open the endpoint and start serving this worker's state to the others."""
        if self._started:
            return
        self.endpoint.bind()
        self.endpoint.connect({rank: f"tcp://{_ip(node.host)}:{node.port}"
                               for rank, node in enumerate(self.config.nodes) if rank != self.rank})
        self._started = True

    def update_send(self, loss: float | torch.Tensor | None = None) -> None:
        """Maybe start fetching one peer's parameters (and publish this worker's on the first call). Never blocks."""
        self.start()
        self.averager.update_send(_as_float(loss))

    def update_wait(self, loss: float | torch.Tensor | None = None) -> dict[str, float]:
        """Count one batch and publish the trained parameters; wait for the fetch begun by
        ``update_send`` (at most ``timeout_ms``) and interpolate with the peer's parameters.
        Returns what happened (peer, factor, wait)."""
        with torch.no_grad():
            return self.averager.update_wait(_as_float(loss))

    @property
    def clock(self) -> float:
        """Batches trained, interpolated with the peers' clocks like the parameters."""
        return self.averager.clock

    @property
    def scores(self) -> dict[str, float]:
        """Each peer's current score (flow control), by name."""
        return {self.config.nodes[rank].name: score for rank, score in self.averager.scores.score.items()}

    def close(self) -> None:
        """Stop serving and fetching; safe to call twice."""
        self.endpoint.close()

    def __enter__(self) -> "GossipAdapter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


DpwaPyTorchAdapter = GossipAdapter


def _as_float(loss: float | torch.Tensor | None) -> float | None:
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def _ip(host: str) -> str:
    """ZeroMQ binds to interfaces by address: ``localhost`` is spelled out."""
    return "127.0.0.1" if host == "localhost" else host


__all__ = ["DpwaPyTorchAdapter", "GossipAdapter", "GossipConfig", "PeerAddress", "load_gossip_config"]
