"""The requester's data server: the task's files (shards, test set, weights, checkpoints to resume
from) for its providers, the checkpoints they send back, reached directly or, behind NAT, through
the bootstrap's relay."""

from __future__ import annotations

import contextlib
from functools import partial
from pathlib import Path

from meshlearn.data import Dataset, partition_dataset, test_samples
from meshlearn.network.channel.addresses import announced_host
from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.identity import pinned, split_pinned
from meshlearn.network.channel.relayagent import hold_allocation
from meshlearn.network.channel.rpc import DEFAULT_MAX_BYTES, RpcServer
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import Named, ProviderRecord
from meshlearn.network.protocol.message import Empty
from meshlearn.network.protocol.requesterapi import (
    Checkpoint,
    CheckpointKept,
    Chunk,
    ChunkData,
)
from meshlearn.network.protocol.serving import relay_requests, serve
from meshlearn.network.requester.context import TaskContext
from meshlearn.network.task.access import TaskAccess
from meshlearn.network.task.datashare import FileShare, write_shard
from meshlearn.network.task.spec import WEIGHTS_FILE

CHECKPOINT_BYTES = 1 << 28  # the largest checkpoint a requester takes when it cannot estimate the model
CHECKPOINT_WORKERS = 8  # requests the requester's server handles at once (each may hold a checkpoint)


class DataServer:
    """Serves the task's files to its providers (and the bootstrap's dial-back) only, on
    ``host``:``port`` (``advertise``: the host other machines reach, if not the one found)."""

    def __init__(self, ctx: TaskContext, host: str = "127.0.0.1", port: int = 0, advertise: str = ""):
        self.ctx = ctx
        self.host, self.port = host, port
        self.advertise = advertise

    def open(self, claimed: list[ProviderRecord], dataset: Dataset | None,
             cleanup: contextlib.ExitStack) -> tuple[FileShare, str]:
        """The task's share (weights, checkpoints to resume from; shards are added per attempt) and
        the pinned address it is served at to ``claimed`` ("" where the task needs no server);
        ``cleanup`` stops it."""
        ctx, req = self.ctx, self.ctx.request
        share = FileShare()
        if req.weights:
            share.add(WEIGHTS_FILE, Path(req.weights))
        if ctx.resume is not None:
            for name, path in ctx.kept.files(ctx.resume.cycles).items():
                share.add(name, path)
        serves = dataset is not None or req.weights or ctx.resume is not None or ctx.keeps_checkpoints
        return share, self._serve(share, claimed, cleanup) if serves else ""

    def handlers(self, share: FileShare) -> dict:
        """The data server's dispatch table (declared in ``protocol.rpcs``): a ping for the
        bootstrap's dial-back, ``share``'s files, and the checkpoints its providers send."""
        return serve(rpcs.Server.REQUESTER, {rpcs.REQUESTER_PING: _ping, rpcs.DATA_CHUNK: partial(_chunk, share),
                                             rpcs.TASK_CHECKPOINT: self._take_checkpoint})

    def write_shards(self, share: FileShare, dataset: Dataset, count: int, folder: Path) -> None:
        """Each of ``count`` providers' shard and the test set, written into ``folder`` and offered by ``share``."""
        req = self.ctx.request
        parts = partition_dataset(dataset, count, req.partition, req.seed)
        for i, part in enumerate(parts):
            path = folder / f"shard-{i}.safetensors"
            indices = part.copy()  # a Partition's parts are read-only views, which torch warns of when indexing
            write_shard(path, dataset.train_x[indices], dataset.train_y[indices])
            share.add(path.name, path)
        test = folder / "test.safetensors"
        write_shard(test, *test_samples(dataset, req.eval_samples))
        share.add(test.name, test)

    def _take_checkpoint(self, message: Checkpoint, req: Envelope) -> CheckpointKept:
        """``task.checkpoint``: keep a provider's checkpoint (``KeptCheckpoints.take``), sent by the
        provider it names (its two blobs: the JSON, the tensors)."""
        meta, tensors = (bytes(blob) for blob in req.blobs)
        kept = self.ctx.kept.take(self.ctx.spec_now, message.task, message.index, message.cycle, meta, tensors,
                                  partial(self._check_provider, req))
        return CheckpointKept(kept=kept)

    def _check_provider(self, req: Envelope, index: int) -> None:
        """Refuse a request unless its channel proved the key of the running attempt's provider
        ``index`` (no check in plain mode, loopback tests only)."""
        if self.ctx.keys is None:
            return
        key = req.caller
        TaskAccess.of(self.ctx.spec_now, "").provider_index(key, req.kind, index)

    def _serve(self, share: FileShare, claimed: list[ProviderRecord], cleanup: contextlib.ExitStack) -> str:
        """Serve ``share`` (files added later are served too) to the claimed providers and the
        bootstrap (its dial-back) only; returns the pinned address providers fetch from."""
        ctx, admitted = self.ctx, self.ctx.roster.admitted
        admitted.update({split_pinned(p.address)[1] for p in claimed} | set(ctx.bootstrap.bootstraps.keys()))
        model_bytes = ctx.estimate.model if ctx.estimate is not None else CHECKPOINT_BYTES
        server = RpcServer("requester", self.host, self.port, ctx.secret, self.handlers(share), keys=ctx.keys,
                           admit=lambda key: key in admitted, max_bytes=max(DEFAULT_MAX_BYTES, 2 * model_bytes),
                           workers=CHECKPOINT_WORKERS)
        wanted = server.bind_any()
        if wanted:
            ctx.say(f"port {wanted} is in use: serving the task's data on {server.port} instead")
        server.start()
        cleanup.callback(server.stop)
        return pinned(self._reached_at(server.port, cleanup), ctx.keys.public if ctx.keys else None)

    def _reached_at(self, port: int, cleanup: contextlib.ExitStack) -> str:
        """HOST:PORT where providers fetch the data: this machine's if the bootstrap can dial it,
        else an allocation of the bootstrap's relay (this requester is behind NAT)."""
        ctx = self.ctx
        address = f"{announced_host(self.host, self.advertise, split_pinned(ctx.bootstrap.address)[0])}:{port}"
        if ctx.keys is None:
            return address
        if ctx.bootstrap.probe(address).reachable:
            return address
        allocation = hold_allocation(relay_requests(ctx.bootstrap.call), self.host, port, Holder("task", ctx.task_id))
        cleanup.callback(allocation.close)
        ctx.say(f"task {ctx.task_id}: the bootstrap cannot reach {address} (NAT or a firewall): "
                f"providers fetch the data through the relay at {allocation.address}")
        return allocation.address


def _ping(message: Empty, req: Envelope) -> Named:
    """``ping``: names the service (the bootstrap's dial-back, so a requester it can reach serves directly)."""
    return Named(service="requester")


def _chunk(share: FileShare, message: Chunk, req: Envelope) -> tuple[ChunkData, list[bytes]]:
    """``data.chunk``: a chunk of one of ``share``'s files (``FileShare.read``), its CRC-32C, and the chunk as the blob."""
    offset, checksum, data = share.read(message.name, message.offset, message.length)
    return ChunkData(offset=offset, crc32c=checksum), [data]
