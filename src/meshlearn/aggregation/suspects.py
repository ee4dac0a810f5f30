"""Which peers look bad: models refused at the edge, and models far from what the rule kept."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVIANT_FACTOR = 4.0  # a model this many times farther from the aggregate than the median model is deviant
RELATIVE_DISTANCE = 0.5  # ... and farther from it than this share of the aggregate's norm
REPEATED = 3  # refusals (or deviant models, if most of a peer's are) before a peer is suspected


@dataclass
class PeerRecord:
    """What one node saw of one peer's models."""

    heard: int = 0
    refused: int = 0
    deviant: int = 0
    last_reason: str = ""


class PeerWatch:
    """Per peer: models heard, refused at the edge (NaN/Inf, wrong size or dtype), and deviant
    (far from the robust aggregate). A peer refused ``REPEATED`` times, or deviant in most of at
    least ``REPEATED`` models, is suspected."""

    def __init__(self) -> None:
        self.peers: dict[int, PeerRecord] = {}

    def _of(self, peer: int) -> PeerRecord:
        return self.peers.setdefault(peer, PeerRecord())

    def refused(self, peer: int, reason: str) -> None:
        record = self._of(peer)
        record.heard += 1
        record.refused += 1
        record.last_reason = reason

    def heard(self, peer: int) -> None:
        self._of(peer).heard += 1

    def observe(self, peers: list[int], models: torch.Tensor, aggregate: torch.Tensor,
                judged: int | None = None) -> None:
        """After a robust aggregation of ``models`` ``[K, P]`` (row 0 the node's own, then one per
        peer of ``peers``) into ``aggregate`` ``[P]``: count the peers whose model is deviant (only
        ``judged``, where the others' models are older ones already judged)."""
        self.count_deviant(peers, deviant_rows(models.unsqueeze(0), aggregate.unsqueeze(0))[0, 1:], judged)

    def count_deviant(self, peers: list[int], deviant: torch.Tensor, judged: int | None = None) -> None:
        """Count the ``peers`` whose ``deviant`` flag [K] is set (only ``judged``, if given)."""
        for peer, bad in zip(peers, deviant.tolist()):
            if bad and (judged is None or peer == judged):
                self._of(peer).deviant += 1

    def suspects(self) -> list[int]:
        """The peers suspected so far, in rank order."""
        return sorted(peer for peer, r in self.peers.items() if suspected(r.heard, r.refused, r.deviant))

    def report(self) -> dict:
        """For the run log and a task's metrics: the suspects, and every peer with a refusal or a
        deviant model."""
        return {"suspected": self.suspects(),
                "peers": {str(peer): r.__dict__ for peer, r in sorted(self.peers.items()) if r.refused or r.deviant}}


def suspected(heard: int, refused: int, deviant: int) -> bool:
    """Whether a peer with these counts is suspected (refused repeatedly, or deviant in most models)."""
    return refused >= REPEATED or (deviant >= REPEATED and 2 * deviant > heard)


def deviant_rows(models: torch.Tensor, aggregate: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` bool: rows of ``models`` ``[B, K, P]`` grossly far from ``aggregate`` ``[B, P]``:
    more than ``DEVIANT_FACTOR`` times farther than the median row, and farther than
    ``RELATIVE_DISTANCE`` of the aggregate's own norm (honest models of one training run differ by
    far less; without this floor, models that have all but agreed make any spread look deviant)."""
    distance = (models - aggregate.unsqueeze(1)).double().square().sum(-1).sqrt()
    typical = distance.median(dim=-1, keepdim=True).values
    floor = RELATIVE_DISTANCE * aggregate.double().square().sum(-1, keepdim=True).sqrt()
    return distance > torch.maximum(DEVIANT_FACTOR * typical, floor).clamp_min(1e-12)


def refusal(vector: torch.Tensor, present: torch.Tensor | None = None, chunk_elements: int = 0) -> str | None:
    """Why a received flat model must not be aggregated (NaN or Inf in what arrived), or None.
    ``present`` (one flag per chunk of ``chunk_elements``) limits the check to chunks that arrived."""
    finite = torch.isfinite(vector)
    if bool(finite.all()):
        return None
    if present is not None:
        bad_chunks = (~finite).nonzero().flatten() // chunk_elements
        if not bool(present.to(vector.device)[bad_chunks].any()):
            return None
    return "its model holds NaN or Inf values"
