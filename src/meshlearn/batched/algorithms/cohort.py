"""The batched engine's runtime of FedAvg on the cohort path (``batched.cohort``): the server's model
in row 0 of the stacked state, the round's drawn clients in the rows after it, for the round only.

Each iteration: the definition draws the cohort (``FedAvg.cohort``: the same draw as every engine's);
each drawn client's row starts from the server's model (with its own momentum, where it has one),
takes the iteration's local steps and pushes its model to the server over the modelled network;
the server averages, by samples, the pushes that came in time (``FedAvg.average``: the same rule as
the definition's merge) and answers every node, as the definition says (a node not drawn takes the
model it would next train from). The rows are then free for the next cohort. The arithmetic, the
modelled clocks and the traffic are the definition's, so a run's models, times and counters are those
of the path that keeps every node's row (models up to the order of a sum); only the log differs: an
iteration's event names the server and the round's clients, not every node.
"""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.batched.algorithms.base import BatchedAlgorithm, BatchedContext, Traffic
from meshlearn.batched.clientstate import ClientStates
from meshlearn.batched.cohort import SERVER_ROW, CohortBatches
from meshlearn.definitions.fedavg import SERVER, FedAvg
from meshlearn.sgd import StackedSGD
from meshlearn.topology.sampling import rounds_of

MOMENTUM = "momentum"  # a client's own momentum row, in ``ClientStates``


class BatchedCohort(BatchedAlgorithm):
    """FedAvg over a population of ``ctx.config.nodes`` clients, ``rules.count`` of them drawn per
    round into rows 1.. of ``ctx.stacked`` (whose row 0 is the server's model). ``batches`` serves
    the drawn clients' batches; ``states`` keeps what a client carries between draws; ``sgd``: the
    rows' optimizer, whose momentum rows a client takes with it."""

    name = "fedavg"
    state_fields = ()

    def __init__(self, ctx: BatchedContext, traffic: Traffic, batches: CohortBatches, states: ClientStates,
                 sgd: StackedSGD):
        super().__init__(ctx, traffic)
        config = ctx.config
        self.rules = FedAvg(rounds_of(config.peer_sampling, config.topology, ctx.graph, config.seed), config.nodes,
                            config.seed, config.settings_of("fedavg"), shard_sizes=ctx.samples)
        self.batches, self.states, self.sgd = batches, states, sgd
        self.clients: list[int] = []  # the round's cohort, in row order (row 1 + j: clients[j])
        others = np.arange(config.nodes, dtype=np.int64)
        self._answer = (np.full(config.nodes - 1, SERVER, dtype=np.int64), others[others != SERVER])  # to every node
        self.steps = 1  # local steps per iteration (the engine's)

    @property
    def capacity(self) -> int:
        """Rows a round's cohort takes."""
        return self.rules.count

    def participants(self) -> list[int]:
        """The ranks the round's log names: the server and the round's clients."""
        return sorted({SERVER, *self.clients})

    def trainers(self, iteration: int) -> list[int]:
        return list(range(SERVER_ROW + 1, SERVER_ROW + 1 + len(self.clients)))

    @torch.no_grad()
    def before_local_steps(self, iteration: int) -> None:
        """The round's cohort: its rows from the server's model, its streams and momentum from where
        each client left them."""
        self.clients = self.rules.cohort(iteration)
        state, counters = self.ctx.stacked.state, self.ctx.stacked.counters
        rows = slice(SERVER_ROW + 1, SERVER_ROW + 1 + len(self.clients))
        state[rows] = state[SERVER_ROW]
        for values in counters.values():
            values[rows] = values[SERVER_ROW]
        self.batches.begin(self.clients)
        if self.sgd.momentum:
            self._take_momentum(rows)

    def _take_momentum(self, rows: slice) -> None:
        """Each client's momentum row into its row of the optimizer (a first draw starts without)."""
        sgd = self.sgd
        if sgd.buffer is None:
            sgd.buffer = torch.zeros_like(sgd.params)
            sgd.started = torch.zeros(sgd.params.shape[0], dtype=torch.bool, device=sgd.params.device)
        sgd.started[rows] = False
        for row, client in enumerate(self.clients, start=rows.start):
            kept = self.states.get(client)
            if kept is not None and MOMENTUM in kept:
                sgd.buffer[row] = torch.from_numpy(kept[MOMENTUM]).to(sgd.buffer.device)
                sgd.started[row] = True

    def _keep_momentum(self) -> None:
        sgd = self.sgd
        for row, client in enumerate(self.clients, start=SERVER_ROW + 1):
            if bool(sgd.started[row]):
                kept = dict(self.states.get(client) or {})
                kept[MOMENTUM] = sgd.buffer[row].cpu().numpy().copy()
                self.states.put(client, kept)

    @torch.no_grad()
    def after_local_steps(self, iteration: int) -> dict[str, np.ndarray]:
        """The drawn clients push their models to the server (modelled, late ones left out), which
        averages them (``FedAvg.average``) into its row and answers every node; each participant's
        columns of the run log, in ``participants`` order."""
        network, clients = self.ctx.network, np.asarray(self.clients, dtype=np.int64)
        state = self.ctx.stacked.state
        network.carry((state.shape[1] + 1) * state.element_size())  # the definition's payload: the model, then a 1
        pushing = clients[clients != SERVER]
        came = np.ones(len(clients), dtype=bool)
        arrived, waited = network.gather(pushing, np.full(len(pushing), SERVER, dtype=np.int64))
        came[clients != SERVER] = arrived
        rows = state[SERVER_ROW + 1:SERVER_ROW + 1 + len(clients)]
        average = self.rules.average(rows, self.clients, came.tolist())
        if average is not None:
            state[SERVER_ROW] = average
        answered, answer_wait = network.gather(*self._answer)
        self.batches.end()
        if self.sgd.momentum:
            self._keep_momentum()
        ranks = np.asarray(self.participants(), dtype=np.int64)
        heard = np.zeros(len(ranks), dtype=np.int64)
        heard[np.searchsorted(ranks, SERVER)] = int(arrived.sum())
        heard[np.searchsorted(ranks, pushing)] = answered[pushing - 1]  # the answer's link to node r: r - 1
        expected = np.ones(len(ranks), dtype=np.int64)
        expected[np.searchsorted(ranks, SERVER)] = len(pushing)
        return {"comm": (waited + answer_wait)[ranks], "received": heard, "missing": expected - heard}
