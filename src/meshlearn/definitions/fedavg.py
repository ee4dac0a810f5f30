"""FedAvg with a parameter server (McMahan et al. 2017): the centralised baseline, so that
federated and decentralized runs compare in one experiment file. One definition, both engines.

Node 0 is the server and trains as a client too. Each iteration has two exchanges (``phases``).
First a seeded share of the nodes (every node draws the same ones) pushes its trained model to
the server, which averages them weighted by their training samples (the seeded partition's shard
sizes, never a count a client sends; a round in which no model came keeps the last average).
Then the server sends the result to every node, and every node trains on from it (one that did not
hear it in time trains on from its own). Nodes that were not drawn skip the round's local steps
(``trains``): their models would be replaced by the server's before being used. So idle nodes cost
nothing, and every node's evaluation is the global model's.

The payload carries a 1 after the model, so the weighted sum the engines compute also gives the
total weight of what arrived: the server divides by it (only what came counts, by samples).

``compress`` (int8, int4): what travels both ways is the change over the round instead of the model,
quantized with error feedback (``compressed``). A client sends its model at the round's start minus
its trained model; the server averages those changes (its own exact) by samples and sends the
average, quantized in turn with its own error feedback; every node, the server too, takes its model
at the round's start minus that decoded average, so all hold the same model. A client that did not
hear the server trains on from its own model, and its next change starts from there.

``fragments`` F (Streaming DiLoCo, Douillard et al. 2025): the state in F contiguous parts of equal
size; iteration i exchanges part i mod F only (``span``), so each part is synchronised every F
iterations, part f at offsets f, f + F, ...: the traffic of a round is spread over F iterations, and
an outer optimizer steps the part just aggregated.

``overlap`` (Streaming DiLoCo's): each iteration's exchange reads the models as pushed and writes
its outcome apart from the models (``state``), so it can run beside the next iteration's local
steps; after them the models take the outcome (``settle``: each node's part as trained kept aside),
the outer optimizer steps it, and before the next steps it is mixed with the part as trained,
``mix * trained + (1 - mix) * outcome`` (``start_round``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshlearn.definitions.base import (
    Exchange,
    RoundAlgorithm,
    State,
    register_algorithm,
)
from meshlearn.definitions.compressed import BITS, DeltaCodec
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import FedAvgSettings
from meshlearn.errors import ConfigError
from meshlearn.settings import Settings
from meshlearn.topology.sampling import Round, Rounds

if TYPE_CHECKING:
    from torch import Tensor


SERVER = 0
SALT = 0xFEDA


def participants(seed: int, iteration: int, nodes: int, count: int) -> list[int]:
    """The ``count`` nodes whose models the server takes at ``iteration`` (sorted; all of them at
    ``nodes``): the same draw in every engine and process."""
    import numpy as np

    if count >= nodes:
        return list(range(nodes))
    return sorted(int(i) for i in np.random.default_rng([seed, SALT, iteration]).choice(nodes, count, replace=False))


@register_algorithm
class FedAvg(RoundAlgorithm):
    """The drawn nodes push to node 0, which averages by samples and answers everyone (see the module)."""

    name = "fedavg"
    summary = "a parameter server, node 0, averages by samples: the federated baseline; the topology is not used"
    needs = Needs(network=True, outer=True, robust=True, byzantine=True, why_not=(
        ("lossy", "its answer is a model each client takes whole"),
        ("sharing", "it has its own: fedavg_compress"),
        ("dynamic", "its clients talk to node 0 only")))
    settings = FedAvgSettings
    phases = 2  # the drawn push to the server; the server answers everyone
    honest_tail = 1  # the 1 after the model: a payload with another is refused, so an attack forges the model only
    talks_to = "server"

    @classmethod
    def conflict(cls, run) -> str | None:
        """A robust rule needs the models themselves at the server (not quantized changes, decoded one
        by one), and the server must be honest (a bad server's answer is everyone's model)."""
        if run.aggregation != "mean" and run.fedavg.compress != "none":
            return (f"aggregation {run.aggregation} with fedavg needs fedavg_compress none (the server's rule "
                    "needs each client's model, not its quantized change)")
        if run.fedavg.compress != "none" and getattr(run, "byzantine", ""):
            return "byzantine nodes with fedavg need fedavg_compress none (attacks forge models, not quantized changes)"
        if hasattr(run, "attackers") and SERVER in run.attackers():  # a simulation's bad nodes
            return (f"byzantine node {SERVER} is fedavg's server, whose answer every node takes: name only "
                    "clients (1 and up) as bad nodes")
        return None

    def __init__(self, rounds: Rounds, nodes: int, seed: int, settings: Settings | None = None,
                 shard_sizes: Sequence[int] = (), ranks: Sequence[int] = ()):
        super().__init__(rounds, nodes, seed, settings, shard_sizes=shard_sizes, ranks=ranks)
        if len(self.shard_sizes) != nodes:
            raise ConfigError("FedAvg's server weighs models by every node's shard sizes, from the seeded partition: "
                              f"it was given {len(self.shard_sizes)} shard sizes for {nodes} nodes")
        options = settings or FedAvgSettings()
        self.count = options.drawn(nodes)  # nodes drawn a round
        self.fragments, self.bits = options.fragments, BITS.get(options.compress, 0)
        self.overlaps, self.mix = options.overlap, options.mix
        from meshlearn.aggregation.weights import by_samples

        self.samples = by_samples(self.shard_sizes)
        self._answer: tuple[Round, tuple[float, ...]] | None = None  # every iteration's second exchange (``answer``)
        self._spans: list[tuple[int, int]] = []  # the parts of the state (one: all of it), from ``begin``
        self._codecs: dict[int, DeltaCodec] = {}  # compress: one per part size
        self._dtype = None  # the models' (from ``begin``)

    @property
    def linear(self) -> bool:
        """The weighted sum of the models sent; not where changes travel quantized (each is decoded)."""
        return not self.bits

    def _part(self, iteration: int) -> tuple[int, int]:
        return self._spans[iteration % len(self._spans)]

    def _codec(self, size: int, dtype) -> DeltaCodec:
        """The codec of changes to ``size`` values (one per part size)."""
        if size not in self._codecs:
            self._codecs[size] = DeltaCodec(size, dtype, self.seed, self.bits)
        return self._codecs[size]

    def answer(self) -> tuple[Round, tuple[float, ...]]:
        """The server's answer to every node (``answer_round``) and each row's own weight in it, the
        same every iteration: made once, when first asked for (the cohort path never asks)."""
        if self._answer is None:
            self._answer = (answer_round(self.nodes), tuple(1.0 if rank == SERVER else 0.0 for rank in self.ranks))
        return self._answer

    def cohort(self, iteration: int) -> list[int]:
        """The nodes drawn for ``iteration``, sorted (every node, where a round takes all)."""
        return participants(self.seed, iteration, self.nodes, self.count)

    def average(self, models: Tensor, ranks: Sequence[int], came: Sequence[bool]) -> Tensor | None:
        """The server's average of ``models`` [k, P] (row j: node ``ranks[j]``'s trained model), by
        samples, of those whose push ``came``; None where none came (the server keeps its last)."""
        import torch

        weights = torch.tensor([self.samples[rank] if arrived else 0.0 for rank, arrived in zip(ranks, came)],
                               dtype=torch.float64)
        total = float(weights.sum())
        if total == 0.0:
            return None
        return (weights / total).to(models.dtype) @ models

    def trains(self, iteration: int) -> list[int] | None:
        """The nodes drawn for ``iteration`` (None: all of them, at fraction 1)."""
        return None if self.count >= self.nodes else participants(self.seed, iteration, self.nodes, self.count)

    def exchange(self, iteration: int, phase: int = 0) -> Exchange:
        """Phase 0: the drawn nodes other than the server push to it, each weighing its samples, the
        server's own model by its samples if it was drawn; a push that did not come is simply not
        averaged. Phase 1: the server sends to everyone, each taking it whole (keeping nothing of
        its own); only a node that did not hear it keeps its own model."""
        if phase == 1:
            answer, weights = self.answer()
            return Exchange(iteration, phase, answer, weights, keeps_missing=True, pools=False)
        n, nobody = self.nodes, ()
        chosen = participants(self.seed, iteration, n, self.count)
        server = self.samples[SERVER] if SERVER in chosen else 0.0
        pushing = tuple(j for j in chosen if j != SERVER)
        push = Round(tuple((SERVER,) if j in pushing else nobody for j in range(n)),
                     (pushing,) + (nobody,) * (n - 1), ({j: self.samples[j] for j in pushing},) + ({},) * (n - 1))
        return Exchange(iteration, phase, push, tuple(server if rank == SERVER else 1.0 for rank in self.ranks),
                        keeps_missing=False)

    def begin(self, own: Tensor) -> State:
        """The last average the server sent (kept by the server's row only); with ``compress``, every
        row's model at the round's start and its error feedback; with ``overlap``, what an exchange
        under way reads (the models as sent, and as at the round's start) and writes (its outcome),
        apart from the models that train on meanwhile, and each node's part as trained when the
        outcome came."""
        self._spans, self._dtype = fragment_spans(own.shape[1], self.fragments), own.dtype
        state = {"global": own[self.ranks.index(SERVER)].clone()} if SERVER in self.ranks and not self.bits else {}
        if self.bits:
            state.update(before=own.clone(), error=own.new_zeros(own.shape))
        if self.overlaps:
            state.update(sent=own.clone(), late=own.clone(), local=own.clone())
            if self.bits:
                state["base"] = own.clone()
        return state

    def merged(self, iteration: int) -> tuple[int, int] | None:
        """The part whose exchange's outcome the models take at ``iteration`` (the part exchanged
        then; with ``overlap``, the one exchanged the iteration before, none at the first)."""
        if not self.overlaps:
            return self._part(iteration)
        return self._part(iteration - 1) if iteration > 0 else None

    def span(self, iteration: int) -> tuple[int, int] | None:
        """The part of the state whose exchange's outcome the models take at ``iteration`` (None:
        all of it, every iteration's)."""
        if self.fragments == 1 and not self.overlaps:
            return None
        return self.merged(iteration) or (0, 0)

    def start_round(self, own: Tensor, state: State, iteration: int) -> None:
        """The part the models took an outcome of last iteration, as each node starts its steps from
        it (after any outer step): with ``compress``, where its next change starts; with
        ``overlap``, mixed with the node's own part as trained meanwhile (Streaming DiLoCo's
        ``mix * own + (1 - mix) * outcome``)."""
        taken = self.merged(iteration - 1) if iteration > 0 else None
        if taken is None:
            return
        a, b = taken
        if self.bits:
            state["before"][:, a:b] = own[:, a:b]
        if self.overlaps:
            own[:, a:b].mul_(1 - self.mix).add_(state["local"][:, a:b], alpha=self.mix)

    def settle(self, own: Tensor, state: State, iteration: int) -> None:
        """With ``overlap``, at ``iteration`` once the exchange of the iteration before is over: each
        node's part as trained is kept aside (``start_round`` mixes it back) and the models take
        the exchange's outcome, for the outer step."""
        taken = self.merged(iteration) if self.overlaps else None
        if taken is None:
            return
        a, b = taken
        state["local"][:, a:b] = own[:, a:b]
        own[:, a:b] = state["late"][:, a:b]

    def _rows(self, own: Tensor, state: State) -> tuple[Tensor, Tensor | None, Tensor]:
        """What the exchange reads as the models and as the models at the round's start, and where
        it writes its outcome: the models themselves, or (``overlap``) copies apart from them."""
        if not self.overlaps:
            return own, state.get("before"), own
        return state["sent"], state.get("base"), state["late"]

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """The part's model, then a 1 (what the weighted sum adds up to the weight that came); with
        ``compress``, the quantized change: each drawn client's in the push, the server's average
        in its answer (the other rows send nothing, and their error feedback is left alone). With
        ``overlap``, the push first copies what the exchange reads."""
        iteration, phase = exchange.iteration, exchange.phase
        a, b = self._part(iteration)
        if self.overlaps and phase == 0:
            state["sent"][:, a:b] = own[:, a:b]
            if self.bits:
                state["base"][:, a:b] = state["before"][:, a:b]
        models, before, outcome = self._rows(own, state)
        if not self.bits:
            sent = own.new_empty((own.shape[0], b - a + 1))
            sent[:, :-1] = (models if phase == 0 else outcome)[:, a:b]
            sent[:, -1] = 1.0
            return sent
        import torch

        codec = self._codec(b - a, self._dtype)
        sent = own.new_zeros((own.shape[0], codec.nbytes), dtype=torch.uint8)
        tag = 2 * iteration + phase  # the rounding's draws: one set per sender and exchange
        if phase == 0:
            drawn = set(participants(self.seed, iteration, self.nodes, self.count))
            for row, rank in enumerate(self.ranks):
                if rank != SERVER and rank in drawn:
                    codec.encode_(before[row, a:b] - models[row, a:b], state["error"][row, a:b], rank, tag, sent[row])
        elif SERVER in self.ranks:
            row = self.ranks.index(SERVER)
            codec.encode_(state.pop("average"), state["error"][row, a:b], SERVER, tag, sent[row])
        return sent

    def payload_problem(self, payload: Tensor, exchange: Exchange) -> str | None:
        """Why a received payload cannot be averaged: a model whose last value is not the 1 the
        server's sum divides by (a client that sends another would set its own weight); with
        ``compress``, a change that cannot be decoded."""
        if not self.bits:
            last = float(payload[-1])
            return None if last == 1.0 else f"its last value is {last:g}, not 1 (FedAvg weighs clients by samples)"
        a, b = self._part(exchange.iteration)
        return self._codec(b - a, self._dtype).problem(payload)

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """Each row's part: the weighted sum over the weight that came; the server with nothing
        come keeps the last average."""
        a, b = self._part(exchange.iteration)
        outcome = self._rows(own, state)[2]
        total = mixed[:, -1:]
        row = self.ranks.index(SERVER) if SERVER in self.ranks else None
        if exchange.phase == 0:  # only the server takes anything: a client's row is its own model over 1, unchanged
            if row is not None:
                if float(total[row]) == 0.0:  # nobody's model this round
                    outcome[row, a:b] = state["global"][a:b]
                else:
                    outcome[row, a:b] = mixed[row, :-1] / total[row]
        else:
            outcome[:, a:b] = mixed[:, :-1] / total.clamp_min(1e-30)
        if row is not None:
            state["global"][a:b] = outcome[row, a:b]

    def merge_stack(self, own: Tensor, state: State, sent: Tensor, received: Tensor, weights: Tensor,
                    own_weight: Tensor, exchange: Exchange) -> None:
        """With ``compress``. The push: the server's average change, by samples, of its own (exact)
        and the decoded changes that came (none come: no change). The answer: every row that has it
        (the server's own) takes its model at the round's start minus the decoded average; one that
        did not trains on from its own model."""
        a, b = self._part(exchange.iteration)
        codec = self._codec(b - a, self._dtype)
        models, before, outcome = self._rows(own, state)
        if exchange.phase == 0:
            if SERVER in self.ranks:
                row = self.ranks.index(SERVER)
                average, total = own.new_zeros(b - a), float(own_weight[row]) + float(weights[row].sum())
                if float(own_weight[row]) > 0:
                    average.add_(before[row, a:b] - models[row, a:b], alpha=float(own_weight[row]))
                for k in range(received.shape[1]):
                    if float(weights[row, k]) > 0:
                        average.add_(codec.decode(received[row, k]).to(own.device), alpha=float(weights[row, k]))
                state["average"] = average.div_(total) if total > 0 else average
            return
        for row, rank in enumerate(self.ranks):
            if rank == SERVER:
                encoded = sent[row]
            elif received.shape[1] and float(weights[row, 0]) > 0:
                encoded = received[row, 0]
            else:  # the answer did not come: its own model (the outcome is the model itself, or a copy to take)
                if outcome is not own:
                    outcome[row, a:b] = models[row, a:b]
                continue
            outcome[row, a:b] = before[row, a:b] - codec.decode(encoded).to(own.device)


def answer_round(nodes: int) -> Round:
    """The server's answer: node 0 sends to every other node, each taking it whole."""
    nobody = ()
    return Round((tuple(range(1, nodes)),) + (nobody,) * (nodes - 1), (nobody,) + ((SERVER,),) * (nodes - 1),
                 ({},) + ({SERVER: 1.0},) * (nodes - 1))


def fragment_spans(numel: int, fragments: int) -> list[tuple[int, int]]:
    """``fragments`` contiguous parts of ``numel`` values, sizes differing by at most one (never
    more parts than values)."""
    count = max(1, min(fragments, numel))
    edges = [numel * f // count for f in range(count + 1)]
    return list(zip(edges[:-1], edges[1:]))
