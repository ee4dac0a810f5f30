"""Bad nodes in the batched engine: what each sends in place of its payload, as in the process engine.

A bad node still trains and merges honestly for itself; only what the nodes hearing it receive is
forged (``meshlearn.attacks``), from the payload its algorithm sends (for D-PSGD its model). The
forged rows are kept apart from the payloads: the links out of a bad node read its forged row, the
node's own row stays its true payload.
"""

from __future__ import annotations

import numpy as np
import torch

from meshlearn.attacks.forge import make_attack
from meshlearn.batched.mixing import Links
from meshlearn.config import ExperimentConfig
from meshlearn.definitions.exchange import BadSenders


class BadNodes:
    """The bad nodes of this process's block (``start`` is its first global rank) and what they
    send. Built with the block's first models ``state``, the run's ``links`` and those into the
    block (``local``): a static graph's, the links ``silent`` and ``reading`` answer for first
    (they answer for any exchange's links)."""

    def __init__(self, config: ExperimentConfig, start: int, state: torch.Tensor, links: Links, local: Links):
        size = state.shape[0]
        attacks = [(rank - start, rank, make_attack(spec)) for rank, spec in sorted(config.attackers().items())
                   if start <= rank < start + size]
        # what they send (the algorithm layer's, the process engine's too), from their first models
        self.senders = BadSenders(attacks, config.seed, state[[row for row, _, _ in attacks]].clone())
        # any bad node of the run (every process must exchange the same number of times)
        everyone = {rank: make_attack(spec) for rank, spec in config.attackers().items()}
        self.rushing = any(attack.rushing for attack in everyone.values())
        # a rushing bad node takes (and sees) its honest neighbours' payloads only, as in the process engine
        self._rushing = torch.tensor([rank for rank, attack in everyone.items() if attack.rushing], dtype=torch.int64)
        self._bad = torch.tensor(sorted(everyone), dtype=torch.int64)
        self._silent: tuple[Links | None, np.ndarray] = (None, np.zeros(0, dtype=bool))  # the last links' (a cache)
        self._reading: tuple[Links | None, Links | None] = (None, None)  # the same
        self.silent(links)
        self.reading(local)

    def __bool__(self) -> bool:
        return bool(self.senders)

    @property
    def rows(self) -> list[int]:
        """The bad nodes' rows in this block."""
        return self.senders.rows

    def silent(self, links: Links) -> np.ndarray:
        """Per link of ``links`` (every link of an exchange), whether its receiver ignores it: a
        rushing bad node's link from a bad node (the last links' answer is kept)."""
        if self._silent[0] is not links:
            receiver, sender = links.receiver.cpu(), links.sender_rank.cpu()
            self._silent = (links, (torch.isin(receiver, self._rushing) & torch.isin(sender, self._bad)).numpy())
        return self._silent[1]

    def reading(self, local: Links) -> Links:
        """``local`` (links into the block, senders indexing the block's rows, then other blocks')
        with those out of a bad node of this block reading its forged row, after those rows (the
        last links' answer is kept)."""
        if self._reading[0] is not local:
            sender = local.sender.clone()
            for k, row in enumerate(self.rows):
                sender[local.sender == row] = local.columns + k
            self._reading = (local, Links(local.nodes, local.columns + len(self.rows), local.receiver, sender,
                                          local.sender_rank, local.weight, local.ids))
        return self._reading[1]

    def forge(self, sent: torch.Tensor, iteration: int, local: Links, silent: np.ndarray,
              seen: torch.Tensor | None = None, tail: int = 0) -> torch.Tensor:
        """``[bad nodes, Q]``: what each bad node sends at ``iteration`` for its payload row of
        ``sent`` (``BadSenders.forged``). A rushing attack looks at ``seen`` (the true payloads the
        exchange's ``local`` links read) over its links, less those ``silent`` says it ignores (per
        link of the run). The payload's last ``tail`` values are sent as they are (``honest_tail``)."""
        ignored = None if seen is None else torch.from_numpy(silent).to(local.receiver.device)[local.ids]
        neighbours = [seen[local.sender[(local.receiver == row) & ~ignored]] if attack.rushing and ignored is not None
                      else None for row, _, attack in self.senders.attacks]
        return self.senders.forged(sent, iteration, neighbours, tail)

    def forge_row(self, row: int, own: torch.Tensor, iteration: int) -> torch.Tensor:
        """What node ``row`` sends for its model ``own`` at ``iteration`` (``own`` for an honest
        node; asynchronous algorithms, where a rushing attack sees no neighbours)."""
        return self.senders.forged_row(row, own, iteration)

    def sent(self, state: torch.Tensor, forged: torch.Tensor) -> torch.Tensor:
        """The block's rows as its nodes send them (for other blocks)."""
        out = state.clone()
        out[self.rows] = forged
        return out


def flipped_labels(config: ExperimentConfig, start: int, stop: int) -> set[int]:
    """The block's nodes (numbered from 0) that train on flipped labels."""
    return {rank - start for rank, spec in config.attackers().items()
            if start <= rank < stop and make_attack(spec).flips_labels}
