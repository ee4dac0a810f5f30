"""A round's weighted sums for every node at once: one sparse product with the mixing matrix, or,
over a lossy network, per chunk of what arrived."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.topology import Graph, mh_row
from meshlearn.topology.sampling import Round


@dataclass
class Links:
    """The run's directed links (sender -> receiver, one per neighbour pair and direction), in
    receiver order, then sender order: the order a process-engine node sums its neighbours in.

    ``receiver`` indexes the rows being averaged (``nodes`` of them), ``sender`` the rows they read
    (``columns``: the same rows in one process; a block's own rows, then those received from other
    blocks, for ``local``); ``sender_rank`` is the sender's global rank, ``weight`` its
    Metropolis-Hastings weight w_ij, ``ids`` each link's place in the whole run's list.
    """

    nodes: int
    columns: int
    receiver: torch.Tensor
    sender: torch.Tensor
    sender_rank: torch.Tensor
    weight: torch.Tensor
    ids: torch.Tensor

    @classmethod
    def of(cls, graph: Graph, device: torch.device | str = "cpu") -> Links:
        """Every link of ``graph``."""
        receivers, senders, weights = [], [], []
        for i in range(graph.n):
            row = mh_row(graph, i)
            for j in graph.neighbours(i):
                receivers.append(i)
                senders.append(j)
                weights.append(row[j])
        sender = torch.tensor(senders, dtype=torch.int64, device=device)
        return cls(graph.n, graph.n, torch.tensor(receivers, dtype=torch.int64, device=device), sender, sender,
                   torch.tensor(weights, dtype=torch.float64, device=device),
                   torch.arange(len(receivers), device=device))

    @classmethod
    def of_round(cls, exchange: Round, device: torch.device | str = "cpu") -> Links:
        """The links of one round of a dynamic topology (``topology.sampling``), with its weights."""
        receivers, senders, weights = [], [], []
        for i, heard in enumerate(exchange.receive_from):
            for j in sorted(heard):
                receivers.append(i)
                senders.append(j)
                weights.append(exchange.weights[i][j])
        sender = torch.tensor(senders, dtype=torch.int64, device=device)
        n = len(exchange.receive_from)
        return cls(n, n, torch.tensor(receivers, dtype=torch.int64, device=device), sender, sender,
                   torch.tensor(weights, dtype=torch.float64, device=device),
                   torch.arange(len(receivers), device=device))

    def local(self, start: int, stop: int, extended: dict[int, int]) -> Links:
        """The links into global ranks ``start .. stop - 1``, receivers numbered from 0 and senders
        by ``extended`` (global rank -> row of the block's extended state)."""
        keep = (self.receiver >= start) & (self.receiver < stop)
        ranks = self.sender[keep]
        rows = torch.tensor([extended[int(j)] for j in ranks.tolist()], dtype=torch.int64, device=ranks.device)
        return Links(stop - start, len(extended), self.receiver[keep] - start, rows, ranks, self.weight[keep],
                     self.ids[keep])

    def __len__(self) -> int:
        return len(self.receiver)

    def slots(self) -> tuple[torch.Tensor, int]:
        """Each link's place among the links into its receiver, and the most links into one node
        (links come in receiver order)."""
        counts = torch.bincount(self.receiver, minlength=self.nodes)
        first = torch.cumsum(counts, 0) - counts
        slot = torch.arange(len(self), device=self.receiver.device) - first[self.receiver]
        return slot, int(counts.max()) if len(self) else 0

    def stack(self, values: torch.Tensor) -> torch.Tensor:
        """Per-link ``values`` [links, ...] as per-node stacks [nodes, K, ...] (K the most links into
        one node; padding zero): the layout of the algorithm layer's rules."""
        slot, width = self.slots()
        out = values.new_zeros((self.nodes, width, *values.shape[1:]))
        out[self.receiver, slot] = values
        return out

    def unstack(self, stacked: torch.Tensor) -> torch.Tensor:
        """Per-node stacks [nodes, K, ...] back to per-link values [links, ...] (``stack``'s inverse)."""
        slot, _ = self.slots()
        return stacked[self.receiver, slot]

    def incoming(self, values: torch.Tensor) -> torch.Tensor:
        """Per receiving node, the sum of ``values`` (one per link) over the links into it."""
        out = torch.zeros(self.nodes, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.receiver, values)


def mixing_matrix(links: Links, weight: torch.Tensor, own: torch.Tensor, dtype: torch.dtype,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse matrix taking each receiver's row to ``own`` times itself plus ``weight`` times
    each of its links' sender rows (one weight per link, one own weight per node); with ``rows``
    (ascending node indices that every link's receiver is among), only those nodes' rows, in order."""
    diagonal = torch.arange(links.nodes, device=links.receiver.device) if rows is None else rows
    receiver = links.receiver
    if rows is not None:  # number the kept rows from 0
        place = torch.empty(links.nodes, dtype=torch.int64, device=rows.device)
        place[rows] = torch.arange(len(rows), device=rows.device)
        receiver, own = place[receiver], own[rows]
    size = (len(diagonal), links.columns)
    kept = own != 0  # a node that keeps nothing of its own (FedAvg's clients hearing the server) does not read it
    coordinates = torch.stack([torch.cat([receiver, torch.arange(len(diagonal), device=diagonal.device)[kept]]),
                               torch.cat([links.sender, diagonal[kept]])])
    values = torch.cat([weight, own[kept]]).to(dtype)
    coo = torch.sparse_coo_tensor(coordinates, values, size, check_invariants=False).coalesce()
    with warnings.catch_warnings():  # torch calls its CSR tensors beta, once per process, on stderr
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        return coo.to_sparse_csr()  # its product reads the rows 10% faster than COO's, bitwise the same


def weighted_sums(links: Links, weight: torch.Tensor, own: torch.Tensor, source: torch.Tensor,
                  sent: torch.Tensor, reusable: bool) -> torch.Tensor:
    """Each node's ``own`` weight times its payload row plus ``weight`` times each of its links'
    sender rows of ``source`` (whose first rows are the nodes' payloads ``sent``). A node that takes
    nothing from another (no link into it, own weight exactly 1) keeps its payload row as it is, so
    where most nodes are such (FedAvg's push to the server), only the others go through the sparse
    product and are written into ``sent`` (when ``reusable``: nothing else holds it); else all do."""
    takes = own != 1.0
    takes[links.receiver] = True
    rows = takes.nonzero().squeeze(1)
    if not reusable or 2 * len(rows) > links.nodes:
        return torch.sparse.mm(mixing_matrix(links, weight, own, sent.dtype), source)
    if len(rows):
        sent[rows] = torch.sparse.mm(mixing_matrix(links, weight, own, sent.dtype, rows), source)
    return sent


class ChunkedMixing:
    """The weighted sum of the payloads when some chunks of some are missing (a lossy UDP link),
    for every node at once: per chunk, a ``missing_chunks`` rule (``definitions.dpsgd``, the
    process engine's too) weighs each sender whose chunk arrived, and the node keeps the rest. A
    sender none of whose chunks arrived counts as not heard, as there. The senders' degrees are
    ``graph``'s (None: the links' own, the links into each sender; one process)."""

    BLOCK_ELEMENTS = 1 << 24  # links x state elements gathered at once (bounds memory)

    def __init__(self, links: Links, graph: Graph | None, rule: str, chunk_elements: int):
        if rule not in MISSING_CHUNK_RULES:
            raise ValueError(f"unknown missing-chunk rule {rule!r}")
        self.links = links
        self.rule = MISSING_CHUNK_RULES[rule]
        self.chunk_elements = chunk_elements
        self.own_weight = 1.0 - links.incoming(links.weight)  # each node's Metropolis-Hastings self weight
        degree = torch.bincount(links.receiver, minlength=links.nodes).to(torch.float64) if graph is None else \
            torch.tensor([graph.degree(i) for i in range(graph.n)], dtype=torch.float64, device=links.weight.device)
        self.sender_degree = links.stack(degree[links.sender_rank])
        self.link_weight = links.stack(links.weight)

    def weights(self, arrived: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per link and chunk, the weight of the sender's chunk; per node and chunk, the node's own
        (``arrived``: [links, chunks], True where the chunk arrived in time)."""
        links = self.links
        per_chunk = self.rule(self.link_weight, links.stack(arrived.to(torch.float64)), self.own_weight,
                              self.sender_degree)
        return links.unstack(per_chunk), 1.0 - per_chunk.sum(1)

    @torch.no_grad()
    def mix_(self, state: torch.Tensor, arrived: torch.Tensor, source: torch.Tensor | None = None) -> None:
        """Average every node's row with the chunks of its neighbours' rows that arrived, in place
        (``source``: the rows the links' senders index, when they are more than ``state``'s own)."""
        state.copy_(self.mixed(state, arrived, source))

    @torch.no_grad()
    def mixed(self, sent: torch.Tensor, arrived: torch.Tensor, source: torch.Tensor | None = None) -> torch.Tensor:
        """``[B, Q]``: every node's payload row of ``sent`` averaged with the chunks of its senders'
        rows that arrived (``arrived``: [links, chunks]; ``source``: the rows the links' senders
        index, when they are more than ``sent``'s own)."""
        source = sent if source is None else source
        links = self.links
        weight, own = self.weights(arrived)
        chunk_of = torch.arange(sent.shape[1], device=sent.device) // self.chunk_elements
        mixed = sent * own[:, chunk_of].to(sent.dtype)
        block = max(1, self.BLOCK_ELEMENTS // max(1, sent.shape[1]))
        for start in range(0, len(links), block):
            part = slice(start, start + block)
            contribution = source[links.sender[part]] * weight[part][:, chunk_of].to(sent.dtype)
            mixed.index_add_(0, links.receiver[part], contribution)
        return mixed
