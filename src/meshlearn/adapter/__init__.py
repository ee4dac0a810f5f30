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

import time
from pathlib import Path

import torch
from torch import nn

from meshlearn.adapter.config import GossipConfig, PeerAddress, load_gossip_config
from meshlearn.errors import ModelError, PortInUseError
from meshlearn.flat import FlatState
from meshlearn.node.algorithms.gossip import GossipAverager
from meshlearn.transport.pull import PullEndpoint

BIND_PATIENCE = 10.0  # seconds a worker retries a port in use before giving up


class GossipAdapter:
    """Wraps one worker's ``nn.Module``: its parameters (and float buffers) are averaged with the
    other workers' of the config by gossip while the worker trains as usual.

    The constructor reads the config, flattens the model's state in place (optimizers built
    before or after keep working) and, as dpwa's does, starts listening, so peers that start
    later find it; ``close()`` (or leaving a ``with`` block) stops it. Accepts dpwa's keyword
    names (``net=``, ``config_file=``) too.
    """

    def __init__(self, model: nn.Module | None = None, name: str | None = None,
                 config: str | Path | dict | list | GossipConfig | None = None, seed: int | None = None, *,
                 net: nn.Module | None = None, config_file: str | Path | None = None):
        model, config = _dpwa_names(model, net, "model", "net"), _dpwa_names(config, config_file, "config", "config_file")
        if model is None or name is None or config is None:
            raise TypeError("GossipAdapter needs a model (or dpwa's net=), a name and a config (or dpwa's config_file=)")
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
        self.start()  # as dpwa does: peers starting later find this worker listening

    def start(self) -> None:
        """Open the endpoint and start serving this worker's state to the others (the constructor
        does; calling it again does nothing)."""
        if self._started:
            return
        deadline = time.monotonic() + BIND_PATIENCE
        while True:
            try:
                self.endpoint.bind()
                break
            except PortInUseError:
                # Perhaps a peer's reconnect holds the port as a TCP self-connect for a moment
                # (it notices and lets go, see transport.served.Caller): wait a little first.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        self.endpoint.connect({rank: f"tcp://{_ip(node.host)}:{node.port}"
                               for rank, node in enumerate(self.config.nodes) if rank != self.rank})
        self._started = True

    def update_send(self, loss: float | torch.Tensor | None = None) -> None:
        """Maybe start fetching one peer's parameters (and publish this worker's on the first call). Never blocks."""
        self.start()
        self._check()
        self.averager.update_send(_as_float(loss))

    def update_wait(self, loss: float | torch.Tensor | None = None) -> dict[str, float]:
        """Count one batch and publish the trained parameters; wait for the fetch begun by
        ``update_send`` (at most ``timeout_ms``) and interpolate with the peer's parameters.
        Returns what happened (peer, factor, wait)."""
        self._check()
        with torch.no_grad():
            return self.averager.update_wait(_as_float(loss))

    def _check(self) -> None:
        moved = self.flat.unbound()
        if moved is not None:
            raise ModelError(f"the model's {moved} is no longer the tensor this adapter averages: the model "
                             f"was converted or moved (.double(), .to(), .cuda()) after the adapter was built; "
                             f"convert or move it first, then build the adapter")
        self.endpoint.check()

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


def _dpwa_names(value, dpwa_value, name: str, dpwa_name: str):
    """One argument given under meshlearn's name or dpwa's keyword, not both."""
    if value is not None and dpwa_value is not None:
        raise TypeError(f"give {name} or {dpwa_name}, not both")
    return value if value is not None else dpwa_value


def _as_float(loss: float | torch.Tensor | None) -> float | None:
    if loss is None:
        return None
    return float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)


def _ip(host: str) -> str:
    """ZeroMQ binds to interfaces by address: ``localhost`` is spelled out."""
    return "127.0.0.1" if host == "localhost" else host


__all__ = ["DpwaPyTorchAdapter", "GossipAdapter", "GossipConfig", "PeerAddress", "load_gossip_config"]
