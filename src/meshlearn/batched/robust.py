"""A round's merge under a robust aggregation rule, for every node at once: each node's rule over
its own payload and the payloads its senders sent that arrived (per chunk, where chunks were lost)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from meshlearn.aggregation.base import AggregationRule
from meshlearn.aggregation.suspects import PeerRecord, PeerWatch
from meshlearn.batched.mixing import Links
from meshlearn.checkpoint import Stateful
from meshlearn.definitions.dpsgd import robust_merge


class RobustMixing(Stateful):
    """Nodes of equal in-degree are aggregated together, ``[B, 1 + degree, Q]`` at a time (B
    bounded so that one block stays under ``BLOCK_ELEMENTS``), by ``robust_merge`` (the algorithm
    layer's, the process engine's too). Counts, per pair of receiver and sender, the payloads heard
    (``heard``) and those that were deviant (``deviant``), for suspicion: ``pairs`` holds each
    pair's key, ``receiver * nodes + sender``, sorted (the links of an exchange may change)."""

    BLOCK_ELEMENTS = 1 << 25
    state_fields = ("pairs", "heard", "deviant")

    def __init__(self, rule: AggregationRule, nodes: int, chunk_elements: int = 0):
        self.rule = rule
        self.nodes = nodes  # of the run: senders' ranks are below it
        self.chunk_elements = chunk_elements
        self.pairs = np.zeros(0, dtype=np.int64)
        self.heard = np.zeros(0, dtype=np.int64)
        self.deviant = np.zeros(0, dtype=np.int64)
        self._groups: tuple[Links | None, list[tuple[torch.Tensor, torch.Tensor]]] = (None, [])  # the last links'

    def groups(self, links: Links) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The receivers of ``links`` by in-degree: (nodes [B], their links [B, d]) per degree d."""
        if self._groups[0] is not links:
            receiver = links.receiver.cpu().numpy()
            degree = np.bincount(receiver, minlength=links.nodes)
            first = np.concatenate([[0], np.cumsum(degree)[:-1]])  # links are sorted by receiver
            groups, device = [], links.receiver.device
            for d in sorted(set(degree.tolist()) - {0}):
                nodes = np.flatnonzero(degree == d)
                positions = first[nodes][:, None] + np.arange(d)[None, :]
                groups.append((torch.as_tensor(nodes, device=device), torch.as_tensor(positions, device=device)))
            self._groups = (links, groups)
        return self._groups[1]

    @torch.no_grad()
    def mixed(self, links: Links, sent: torch.Tensor, source: torch.Tensor, arrived: torch.Tensor,
              weight: torch.Tensor, own_weight: torch.Tensor) -> torch.Tensor:
        """``[B, Q]``: every node's rule over its own payload row of ``sent`` (weight ``own_weight``
        [B]: its own, plus what it keeps of senders not heard; 0: left out) and its links' sender
        rows of ``source`` that arrived (``arrived``: ``[links]``, whole payloads, or ``[links,
        chunks]``; ``weight``: each link's, 0 where nothing arrived). A node that heard nobody gets
        its weighted sum, ``own_weight`` times its payload, as in the process engine."""
        present = arrived if arrived.dim() == 2 else arrived[:, None]
        heard = present.any(1)
        result = sent * own_weight.to(sent.dtype)[:, None]
        deviant = torch.zeros(len(links), dtype=torch.bool)
        for nodes, positions in self.groups(links):
            pooled = heard[positions].any(1)  # a node that heard nobody keeps its weighted sum
            for rows, where in self.blocks(nodes[pooled], positions[pooled], sent.shape[1]):
                out, flags = robust_merge(self.rule, sent[rows], source[links.sender[where]], weight[where],
                                          present[where], self.chunk_elements, own_weight=own_weight[rows])
                if flags is not None:
                    deviant[where[flags].cpu()] = True
                result[rows] = out
        self._count(links, heard.cpu().numpy(), deviant.numpy())
        return result

    def blocks(self, nodes: torch.Tensor, positions: torch.Tensor,
               width: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``nodes`` [B] of one in-degree d with their links' ``positions`` [B, d], in blocks that
        keep ``[block, 1 + d, width]`` under ``BLOCK_ELEMENTS``."""
        block = max(1, self.BLOCK_ELEMENTS // ((positions.shape[1] + 1) * max(1, width)))
        for start in range(0, len(nodes), block):
            yield nodes[start:start + block], positions[start:start + block]

    def _count(self, links: Links, heard: np.ndarray, deviant: np.ndarray) -> None:
        """Add one exchange's ``heard`` and ``deviant`` flags (per link of ``links``) to the pairs' counts."""
        keys = links.receiver.cpu().numpy() * self.nodes + links.sender_rank.cpu().numpy()
        if not np.isin(keys, self.pairs).all():
            pairs = np.union1d(self.pairs, keys)
            place = np.searchsorted(pairs, self.pairs)
            self.heard, self.deviant = _spread(self.heard, place, len(pairs)), _spread(self.deviant, place, len(pairs))
            self.pairs = pairs
        place = np.searchsorted(self.pairs, keys)
        np.add.at(self.heard, place, heard.astype(np.int64))
        np.add.at(self.deviant, place, deviant.astype(np.int64))

    def reports(self) -> dict[int, dict]:
        """Per node that found any sender's payload deviant, its ``PeerWatch`` report (the
        process engine's), from the counts per pair."""
        watches: dict[int, PeerWatch] = {}
        for key in self.pairs[np.flatnonzero(self.deviant)]:
            place = np.searchsorted(self.pairs, key)
            receiver, sender = divmod(int(key), self.nodes)
            watch = watches.setdefault(receiver, PeerWatch())
            watch.peers[sender] = PeerRecord(heard=int(self.heard[place]), deviant=int(self.deviant[place]))
        return {rank: watch.report() for rank, watch in watches.items()}


def _spread(counts: np.ndarray, place: np.ndarray, size: int) -> np.ndarray:
    """``counts`` moved to positions ``place`` of an array of ``size`` zeros."""
    out = np.zeros(size, dtype=np.int64)
    out[place] = counts
    return out
