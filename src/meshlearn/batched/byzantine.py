"""Bad nodes in the batched engine: what each sends in place of its model, as in the process engine.

A bad node still trains and averages honestly for itself; only what its neighbours receive is
forged (``meshlearn.attacks``). The forged rows are kept apart from the state: the links out of a
bad node read its forged row, the node's own row stays its true model.
"""

from __future__ import annotations

import torch

from meshlearn.attacks.forge import Attack, make_attack
from meshlearn.batched.mixing import Links
from meshlearn.config import ExperimentConfig


class BadNodes:
    """The bad nodes of this process's block (``start`` is its first global rank) and what they
    send; ``links`` are the run's, ``local`` those into the block. ``skipped``: per link of the
    run, whether its receiver ignores it (a rushing bad node takes its honest neighbours' models
    only)."""

    def __init__(self, config: ExperimentConfig, start: int, state: torch.Tensor, links: Links, local: Links):
        self.seed = config.seed
        size = state.shape[0]
        self.attacks: list[tuple[int, Attack]] = [
            (rank - start, make_attack(spec)) for rank, spec in sorted(config.attackers().items())
            if start <= rank < start + size]
        rows = [row for row, _ in self.attacks]
        self.start = start
        # any bad node of the run (every process must exchange the same number of times)
        everyone = {rank: make_attack(spec) for rank, spec in config.attackers().items()}
        self.rushing = any(attack.rushing for attack in everyone.values())
        # a rushing bad node takes (and sees) its honest neighbours' models only, as in the process engine
        rushing = torch.tensor([rank for rank, attack in everyone.items() if attack.rushing], dtype=torch.int64)
        bad = torch.tensor(sorted(everyone), dtype=torch.int64)
        receiver, sender = links.receiver.cpu(), links.sender_rank.cpu()
        self.skipped = (torch.isin(receiver, rushing) & torch.isin(sender, bad)).numpy()  # per link of the run
        self._skipped_local = torch.from_numpy(self.skipped).to(local.receiver.device)[local.ids]
        self.initial = state[rows].clone()  # each bad node's first model (``stale``)
        self.local = local
        # the links out of a bad node of this block read its forged row, after the extended state
        sender = local.sender.clone()
        for k, row in enumerate(rows):
            sender[local.sender == row] = local.columns + k
        self.links = Links(local.nodes, local.columns + len(rows), local.receiver, sender, local.sender_rank,
                           local.weight, local.ids)

    def __bool__(self) -> bool:
        return bool(self.attacks)

    @property
    def rows(self) -> list[int]:
        """The bad nodes' rows in this block."""
        return [row for row, _ in self.attacks]

    def forge(self, state: torch.Tensor, iteration: int, seen: torch.Tensor | None = None) -> torch.Tensor:
        """``[bad nodes, P]``: what each bad node sends at ``iteration`` (``seen``: the extended
        true state, the neighbours' models a rushing attack looks at)."""
        out = state.new_empty(len(self.attacks), state.shape[1])
        for k, (row, attack) in enumerate(self.attacks):
            neighbours = None
            if attack.rushing and seen is not None:
                neighbours = seen[self.local.sender[(self.local.receiver == row) & ~self._skipped_local]]
            out[k] = attack.sent(state[row], self.initial[k], self.seed, self.start + row, iteration, neighbours)
        return out

    def forge_row(self, row: int, own: torch.Tensor, iteration: int) -> torch.Tensor:
        """What node ``row`` sends for its model ``own`` at ``iteration`` (``own`` for an honest
        node; asynchronous algorithms, where a rushing attack sees no neighbours)."""
        k = next((k for k, (bad_row, _) in enumerate(self.attacks) if bad_row == row), None)
        return own if k is None else \
            self.attacks[k][1].sent(own, self.initial[k], self.seed, self.start + row, iteration)

    def sent(self, state: torch.Tensor, forged: torch.Tensor) -> torch.Tensor:
        """The block's rows as its nodes send them (for other blocks)."""
        out = state.clone()
        out[self.rows] = forged
        return out


def flipped_labels(config: ExperimentConfig, start: int, stop: int) -> set[int]:
    """The block's nodes (numbered from 0) that train on flipped labels."""
    return {rank - start for rank, spec in config.attackers().items()
            if start <= rank < stop and make_attack(spec).flips_labels}
