"""How both engines' round runners carry out a ``RoundAlgorithm``'s exchanges, written once: the
order of an iteration's exchanges and the overlapped one (``run_exchanges``), which merge a node
takes of what came and with which weights (``merge_came``), and what bad nodes send in place of
their payloads (``BadSenders``).

Each engine gives only its own mechanics: the process engine's round runner for its one node
over the messages it received (a thread beside the local steps for an overlapped exchange), the
batched engine's for every node over [N, ...] link tensors (modelled clocks). Torch at import: no
module the configuration imports loads this one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from meshlearn.definitions.base import Exchange, RoundAlgorithm, State

Counts = dict[str, Any]  # a run log's counters of the exchanges: floats (one node's) or arrays (every node's)
OneExchange = Callable[[Exchange, int, "torch.Tensor | None"], Counts]  # (exchange, its tag, its payload made)
ROBUST, CHUNKED, SUM, STACK = "robust", "chunked", "sum", "stack"  # the merges of ``merge_rule``


def add_counts(total: Counts, counts: Counts) -> Counts:
    """``total`` with ``counts`` added, name by name (a name new to it appended)."""
    for name, value in counts.items():
        total[name] = total[name] + value if name in total else value
    return total


def phases(rules: RoundAlgorithm, iteration: int, exchange_one: OneExchange, first: Exchange | None = None,
           sent: torch.Tensor | None = None) -> Counts:
    """Every exchange of ``iteration`` in order through the engine's ``exchange_one(exchange, tag,
    payload)`` (``tag``: its number on the wire, one per phase; ``payload``: the first one's, where
    ``sent`` made it already, for the exchange ``first``); their counters summed."""
    total: Counts = {}
    for phase in range(rules.phases):
        exchange = first if phase == 0 and first is not None else rules.exchange(iteration, phase)
        add_counts(total, exchange_one(exchange, iteration * rules.phases + phase, sent if phase == 0 else None))
    return total


def run_exchanges(rules: RoundAlgorithm, own: torch.Tensor, state: State, iteration: int, iterations: int,
                  run_phases: Callable[..., Counts], join: Callable[[], Counts],
                  overlap: Callable[[Callable[[], Counts]], Counts]) -> Counts:
    """An iteration's exchanges after its local steps, and the run log's counters of them. Without
    ``overlaps``: ``run_phases(iteration)`` (the engine's ``phases``). With it: ``join()`` (the
    engine waits for the exchange under way, the iteration before's: the record so far, ``comm``
    what the local steps did not hide), this iteration's push (none at the last), and
    ``overlap(exchanges)``: the engine has ``exchanges`` (``run_phases(iteration, sent, first)``,
    its time counted as ``exchange``) run beside the next local steps and says what the record
    adds now (its counters, where the engine ran it at once)."""
    if not rules.overlaps:
        return run_phases(iteration)
    record = join()
    first = rules.exchange(iteration, 0)
    with torch.no_grad():
        sent = rules.push(own, state, first, last=iteration + 1 == iterations)
    if sent is None:
        return record
    return add_counts(record, overlap(lambda: as_overlapped(run_phases(iteration, sent, first))))


def as_overlapped(counts: Counts) -> Counts:
    """An overlapped exchange's counters: its own time as ``exchange`` (``comm`` is the wait for it)."""
    counts["exchange"] = counts.pop("comm", 0.0)
    return counts


def merge_rule(rules: RoundAlgorithm, exchange: Exchange, robust: bool, chunked: bool) -> str:
    """Which merge a node takes of what came in ``exchange``: the run's rule where it is ``robust``
    (not the mean) and the exchange ``pools`` (a node that heard nobody keeps its weighted sum:
    ``Came.robust``); the weighted sum per chunk of what arrived where some chunks or payloads of
    a lossy transport are missing (``chunked``); else the weighted sum for a ``linear``
    definition, its own rule over the stack of what came for another."""
    if robust and exchange.pools:
        return ROBUST
    if chunked:
        return CHUNKED
    return SUM if rules.linear else STACK


class Came(Protocol):
    """What came in one exchange, as an engine holds it (the process engine's messages for its
    node, the batched engine's links for every node), and its ways of merging it, each giving
    the input of the definition's ``merge`` (the models themselves where it wrote into them):
    ``merge_came`` chooses one. ``weights`` and ``own_weight`` are in the engine's own form."""

    own_weight: Any  # each node's weight on its own payload (the exchange's)

    def weights(self) -> Any:
        """Each sender's weight, 0 (or left out) where its payload did not come."""

    def unheard(self, weights: Any) -> Any:
        """Per node, the weights of the senders whose payloads did not come."""

    def chunked_sum(self) -> torch.Tensor:
        """The weighted sum per chunk of what arrived (``missing_chunks``), own weight the exchange's."""

    def robust(self, weights: Any, own_weight: Any) -> torch.Tensor:
        """The run's robust rule over each node's payload and those that came (one that heard
        nobody: its weighted sum, ``own_weight`` times its payload)."""

    def weighted_sum(self, weights: Any, own_weight: Any) -> torch.Tensor:
        """The weighted sum of each node's payload and those that came."""

    def stack(self, weights: Any, own_weight: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What came as ``merge_stack`` takes it: received [B, K, Q], weights [B, K], own weight [B]."""


def merge_came(rules: RoundAlgorithm, exchange: Exchange, own: torch.Tensor, state: State, sent: torch.Tensor,
               came: Came, robust: bool, chunked: bool) -> None:
    """In place: the definition's merge of the nodes' payloads ``sent`` and what ``came`` in
    ``exchange``, by ``merge_rule``; a node keeps the weight of the senders it did not hear where
    the exchange ``keeps_missing`` (D-PSGD's rule; per chunk, the missing-value rule decides)."""
    how = merge_rule(rules, exchange, robust, chunked)
    if how == CHUNKED:
        mixed = came.chunked_sum()
    else:
        weights = came.weights()
        own_weight = came.own_weight + came.unheard(weights) if exchange.keeps_missing else came.own_weight
        if how == STACK:
            rules.merge_stack(own, state, sent, *came.stack(weights, own_weight), exchange)
            return
        mixed = came.robust(weights, own_weight) if how == ROBUST else came.weighted_sum(weights, own_weight)
    if mixed is not own:
        rules.merge(own, state, mixed, exchange)


class Attack(Protocol):
    """What ``BadSenders`` needs of a bad node's behaviour (an ``attacks.forge.Attack``)."""

    def sent(self, own: torch.Tensor, initial: torch.Tensor, seed: int, rank: int, iteration: int,
             neighbours: torch.Tensor | None = None) -> torch.Tensor:
        """What node ``rank`` sends at ``iteration`` in place of ``own``."""


class BadSenders:
    """What the bad nodes among an engine's rows send in place of their payloads, in both engines.
    ``attacks``: (row, global rank, attack) of each; ``first``: their first models [bad, P] (None:
    none kept). A bad node's attack forges what it sends from its row's payload, with its first
    payload of that width (what ``stale`` sends; of the model's width, its first model), the
    honest payloads it saw (a rushing attack) and the generator both engines draw from; a
    definition's ``honest_tail`` (a payload's last values, which its receivers check) is sent as
    it is."""

    def __init__(self, attacks: Sequence[tuple[int, int, Attack]], seed: int, first: torch.Tensor | None = None):
        self.attacks, self.seed = list(attacks), seed
        self.first: dict[int, torch.Tensor] = {} if first is None else {first.shape[1]: first}

    def __bool__(self) -> bool:
        return bool(self.attacks)

    @property
    def rows(self) -> list[int]:
        """The bad nodes' rows."""
        return [row for row, _, _ in self.attacks]

    def forged(self, sent: torch.Tensor, iteration: int, seen: Sequence[torch.Tensor | None] | None = None,
               tail: int = 0) -> torch.Tensor:
        """``[bad, Q]``: what each bad row sends at ``iteration`` for its payload row of ``sent``
        [B, Q] (``seen``: per bad row, the honest payloads [D, Q] its rushing attack saw, or None;
        ``tail``: the definition's ``honest_tail``)."""
        if sent.shape[1] not in self.first:
            self.first[sent.shape[1]] = sent[self.rows].clone()
        initial = self.first[sent.shape[1]]
        out = sent[self.rows].clone() if tail else sent.new_empty(len(self.attacks), sent.shape[1])
        width = sent.shape[1] - tail  # what an attack forges
        for k, (row, rank, attack) in enumerate(self.attacks):
            neighbours = None if seen is None or seen[k] is None else seen[k][:, :width]
            out[k, :width] = attack.sent(sent[row, :width], initial[k, :width], self.seed, rank, iteration, neighbours)
        return out

    def forged_row(self, row: int, own: torch.Tensor, iteration: int) -> torch.Tensor:
        """What row ``row`` sends for its model ``own`` [P] at ``iteration``: ``own`` for an honest
        row (an exchange where no attack sees the others' payloads first: a sharing scheme's,
        gossip's pulls, the leader's pushes); with no first model kept, a bad row's is ``own``."""
        k = next((k for k, (bad_row, _, _) in enumerate(self.attacks) if bad_row == row), None)
        if k is None:
            return own
        initial = self.first[own.numel()][k] if own.numel() in self.first else own
        return self.attacks[k][2].sent(own, initial, self.seed, self.attacks[k][1], iteration)
