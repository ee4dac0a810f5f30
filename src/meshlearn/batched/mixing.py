"""D-PSGD's averaging step for every node at once: one sparse product with the mixing matrix."""

from __future__ import annotations

import torch

from meshlearn.topology import Graph, mh_row


class Links:
    """The run's directed links (sender -> receiver, one per neighbour pair and direction), in
    receiver order, then sender order: the order a process-engine node sums its neighbours in."""

    def __init__(self, graph: Graph, device: torch.device | str = "cpu"):
        receivers, senders, weights = [], [], []
        for i in range(graph.n):
            row = mh_row(graph, i)
            for j in graph.neighbours(i):
                receivers.append(i)
                senders.append(j)
                weights.append(row[j])
        self.nodes = graph.n
        self.receiver = torch.tensor(receivers, dtype=torch.int64, device=device)
        self.sender = torch.tensor(senders, dtype=torch.int64, device=device)
        self.weight = torch.tensor(weights, dtype=torch.float64, device=device)  # Metropolis-Hastings w_ij

    def __len__(self) -> int:
        return len(self.receiver)

    def incoming(self, values: torch.Tensor) -> torch.Tensor:
        """Per node, the sum of ``values`` (one per link) over the links into it."""
        out = torch.zeros(self.nodes, dtype=values.dtype, device=values.device)
        return out.index_add_(0, self.receiver, values)


class MetropolisMixing:
    """``X <- W X`` with the Metropolis-Hastings matrix W of the graph, where a link whose model
    did not arrive in time gives its weight to the receiver's own model (as a process-engine
    D-PSGD node does when a neighbour misses its deadline)."""

    def __init__(self, links: Links):
        self.links = links
        n = links.nodes
        self._diagonal = torch.arange(n, device=links.receiver.device)

    def matrix(self, state: torch.Tensor, arrived: torch.Tensor | None = None) -> torch.Tensor:
        """The iteration's mixing matrix (sparse, the state's dtype)."""
        links = self.links
        weight = links.weight if arrived is None else links.weight * arrived.to(links.weight.dtype)
        own = 1.0 - links.incoming(weight)
        rows = torch.cat([links.receiver, self._diagonal])
        cols = torch.cat([links.sender, self._diagonal])
        values = torch.cat([weight, own]).to(state.dtype)
        size = (links.nodes, links.nodes)
        return torch.sparse_coo_tensor(torch.stack([rows, cols]), values, size, check_invariants=False).coalesce()

    @torch.no_grad()
    def mix_(self, state: torch.Tensor, arrived: torch.Tensor | None = None) -> None:
        """Average every node's row with its neighbours' rows, in place."""
        state.copy_(torch.sparse.mm(self.matrix(state, arrived), state))
