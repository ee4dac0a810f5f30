"""Build a ready-to-run Node from a configuration: data shard, model, transport, log."""

from __future__ import annotations

from pathlib import Path

import torch

from meshlearn.checkpoint import RunCheckpoints
from meshlearn.config import ExperimentConfig, load_run_dataset
from meshlearn.data import partition_dataset, require_materialized
from meshlearn.definitions.base import definition
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.node.node import Node
from meshlearn.plugins import load_user_module
from meshlearn.runlog import JsonlLog
from meshlearn.sharing import make_sharing
from meshlearn.topology import Graph
from meshlearn.transport import Endpoint, TcpTransport, Unconnected
from meshlearn.transport.hub import HubEndpoint
from meshlearn.transport.pull import PullEndpoint
from meshlearn.transport.udp import ETHERNET_CHUNK, UdpTransport
from meshlearn.wire.sealed import FrameSeal
from meshlearn.wire.sealed_datagram import DatagramSeal

SERVED = {"pull": PullEndpoint, "hub": HubEndpoint}  # the endpoints that serve requests, by declared kind


def make_transport(
    config: ExperimentConfig, rank: int, flat: FlatState, host: str | None = None, port: int | None = None,
    secret: bytes | None = None, seal: FrameSeal | None = None,
) -> Endpoint:
    """The endpoint the configuration's algorithm needs, for node ``rank`` and its state layout
    (not yet bound). With ``secret`` every message is signed and unsigned ones are dropped
    (not over UDP, which refuses a secret); with ``seal`` every message is encrypted with a
    task's key (network tasks; over UDP, every datagram on its own)."""
    if port is None:
        port = config.base_port + rank if config.base_port else 0
    host = host or config.host
    needed = definition(config.algorithm).needs.endpoint  # the algorithm's declaration
    if needed == "none":
        return Unconnected(rank)
    if needed in SERVED:  # request and answer, over TCP
        return SERVED[needed](rank, host, port, settings=config.tcp, secret=secret, seal=seal)
    netem = config.net
    if config.loss_mode == "kernel":  # the kernel drops real packets (meshlearn.sim.kernelnet)
        netem = netem.without_loss()
    if config.transport == "udp":
        if secret:
            raise ConfigError("the UDP transport does not sign datagrams with a shared secret: a network task seals "
                              "them with its key instead")
        udp = config.udp
        if not udp.chunk_bytes and config.loss_mode == "kernel":
            # in a lossy namespace lo has an Ethernet MTU (sim.kernelnet): size datagrams for it
            udp = udp.model_copy(update={"chunk_bytes": ETHERNET_CHUNK})
        layout = TensorLayout.uniform(flat.ranges, flat.state.dtype)
        if config.sharing != "full":  # the scheme's messages; an earlier one's chunks hold other positions
            layout = make_sharing(config.sharing, flat.state.numel(), flat.state.dtype, config.seed,
                                  lossy=True).layout()
            udp = udp.model_copy(update={"late_chunks": "drop"})
        return UdpTransport(rank, host, port, layout=layout, settings=udp, netem=netem, seed=config.seed,
                            seal=DatagramSeal(seal.key) if seal is not None else None)
    return TcpTransport(rank, host, port, settings=config.tcp, netem=netem, seed=config.seed, secret=secret,
                        seal=seal)


def build_node(
    config: ExperimentConfig,
    rank: int,
    graph: Graph,
    log_dir: str | Path | None = None,
    host: str | None = None,
    port: int | None = None,
    resume: int | None = None,
) -> Node:
    """A Node for ``rank``: its shard of the dataset (seeded split), a model, an optimizer.

    Every node starts from the same initial model (seeded by ``config.seed``), as D-PSGD's
    analysis assumes; shard order is seeded per node. With a ``log_dir`` (a run's results folder's
    ``logs``) it keeps checkpoints in that folder, as the configuration says; ``resume``: it
    starts from its checkpoint of that iteration.
    """
    if config.models_module:
        load_user_module(config.models_module)
    dataset = load_run_dataset(config)
    require_materialized(dataset)
    parts = partition_dataset(dataset, config.nodes, config.partition, config.seed)
    torch.manual_seed(config.seed)
    model = build_model(config.model, dataset.input_shape, dataset.num_classes)
    log = JsonlLog(Path(log_dir) / f"node_{rank}.jsonl", append=resume is not None) if log_dir is not None else None
    checkpoints = RunCheckpoints(Path(log_dir).parent, checkpoint_name(rank), config.fingerprint(),
                                 config.checkpoint_keep) if log_dir is not None and config.checkpoint_interval else None
    return Node(rank, config, graph, dataset, parts[rank], model,
                lambda flat: make_transport(config, rank, flat, host, port), log,
                shard_sizes=[len(part) for part in parts], checkpoints=checkpoints, resume=resume)


def checkpoint_name(rank: int) -> str:
    """The name node ``rank``'s checkpoints go by in its run's checkpoints folder."""
    return f"node-{rank}"
