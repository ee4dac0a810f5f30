"""D-PSGD's step with a robust aggregation rule, for every node at once: each node's rule over its
own row and the rows its neighbours sent that arrived (per chunk, where chunks were lost)."""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.aggregation.base import AggregationRule
from meshlearn.aggregation.suspects import PeerRecord, PeerWatch
from meshlearn.batched.mixing import Links
from meshlearn.checkpoint import Stateful
from meshlearn.definitions.dpsgd import robust_merge


class RobustMixing(Stateful):
    """Nodes of equal in-degree are aggregated together, ``[B, 1 + degree, P]`` at a time (B
    bounded so that one block stays under ``BLOCK_ELEMENTS``). A node's own weight is its
    Metropolis-Hastings weight plus those of the links that did not arrive, as in the process
    engine. Counts, per link, the models that were deviant (``deviant``), for suspicion."""

    BLOCK_ELEMENTS = 1 << 25
    state_fields = ("deviant", "heard")

    def __init__(self, links: Links, rule: AggregationRule, chunk_elements: int = 0):
        self.links = links
        self.rule = rule
        self.chunk_elements = chunk_elements
        receiver = links.receiver.cpu().numpy()
        degree = np.bincount(receiver, minlength=links.nodes)
        first = np.concatenate([[0], np.cumsum(degree)[:-1]])  # links are sorted by receiver
        self.groups = []  # (nodes [B], their links [B, d])
        for d in sorted(set(degree.tolist()) - {0}):
            nodes = np.flatnonzero(degree == d)
            positions = first[nodes][:, None] + np.arange(d)[None, :]
            device = links.receiver.device
            self.groups.append((torch.as_tensor(nodes, device=device), torch.as_tensor(positions, device=device)))
        self.deviant = np.zeros(len(links), dtype=np.int64)
        self.heard = np.zeros(len(links), dtype=np.int64)

    @torch.no_grad()
    def mix_(self, state: torch.Tensor, source: torch.Tensor, arrived: torch.Tensor) -> None:
        """Every node's row <- the rule over it and its neighbours' rows of ``source`` (the rows the
        links' senders index: what they sent) that arrived: ``arrived`` is ``[links]`` (whole
        models) or ``[links, chunks]``."""
        links = self.links
        present = arrived if arrived.dim() == 2 else arrived[:, None]
        heard = present.any(1)
        self.heard += heard.cpu().numpy()
        weight = links.weight * heard.to(links.weight.dtype)
        result = state.clone()  # a node without neighbours keeps its model
        for nodes, positions in self.groups:
            d = positions.shape[1]
            block = max(1, self.BLOCK_ELEMENTS // ((d + 1) * max(1, state.shape[1])))
            for start in range(0, len(nodes), block):
                rows, where = nodes[start:start + block], positions[start:start + block]
                out, deviant = robust_merge(self.rule, state[rows], source[links.sender[where]], weight[where],
                                            present[where], self.chunk_elements)
                if deviant is not None:
                    np.add.at(self.deviant, where.cpu().numpy()[deviant.cpu().numpy()], 1)
                result[rows] = out
        state.copy_(result)

    def reports(self) -> dict[int, dict]:
        """Per node that found any neighbour's model deviant, its ``PeerWatch`` report (the
        process engine's), from the counts per link."""
        watches: dict[int, PeerWatch] = {}
        receiver = self.links.receiver.cpu().numpy()
        sender = self.links.sender_rank.cpu().numpy()
        for link in np.flatnonzero(self.deviant):
            watch = watches.setdefault(int(receiver[link]), PeerWatch())
            watch.peers[int(sender[link])] = PeerRecord(heard=int(self.heard[link]), deviant=int(self.deviant[link]))
        return {rank: watch.report() for rank, watch in watches.items()}
