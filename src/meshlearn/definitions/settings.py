"""The algorithms' settings. Kept apart from the algorithms (no torch here), so a configuration is
validated, and the command line answers, without loading them."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from meshlearn.privacy.settings import CENTRAL_DP_HELP, CentralDPSettings
from meshlearn.settings import Settings


class DpsgdSettings(Settings):
    """D-PSGD's settings."""

    missing_chunks: Literal["per-chunk", "fill-local"] = Field(
        "per-chunk", description="over a lossy transport (UDP), how chunks that did not arrive are averaged: "
        "per-chunk (Metropolis-Hastings weights renormalised over who delivered each chunk) or fill-local "
        "(the UDP study's rule: a lost chunk counts as the node's own values)")


class GossipSettings(Settings):
    """dpwa's knobs: how often to fetch, how long to wait, and how much of the peer to take.
    (Flat names in experiment files: ``fetch_timeout``, ``interpolation_value``, ``fetch_fresh``;
    dpwa's YAML names them ``timeout_ms``, ``constant`` and meshlearn's ``fresh``.)"""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"timeout": "fetch_timeout", "value": "interpolation_value",
                                            "fresh": "fetch_fresh"}

    fetch_probability: float = Field(1.0, ge=0, le=1, description="chance of fetching a peer each step")
    timeout: float = Field(2.5, gt=0, description="seconds to wait for a fetch (dpwa's timeout_ms / 1000)")
    interpolation: Literal["constant", "clock", "loss"] = Field(
        "constant", description="how much of the peer to take: constant (value), clock (peer_clock / "
        "(clock + peer_clock)) or loss (loss / (loss + peer_loss))")
    value: float = Field(0.5, ge=0, le=1, description="the constant interpolation factor")
    divergence_threshold: float = Field(0.0, ge=0, description="below this loss take less of peers (0 = off)")
    fresh: bool = Field(True, description="ask a peer for the state it finishes while this node trains "
                                          "(false: the one it already has, as dpwa)")


class LeaderSettings(Settings):
    """Leader aggregation's settings (flat names: ``leader_first_barrier``, ``leader_weighting``,
    ``leader_sync``, ``leader_fraction``, ``secure_aggregation``, ``central_dp``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"first_barrier": "leader_first_barrier", "weighting": "leader_weighting",
                                            "sync": "leader_sync", "fraction": "leader_fraction",
                                            "secure": "secure_aggregation", "central_dp": "central_dp"}

    first_barrier: bool = Field(True, description="the first cycle waits (up to the peer timeout) for every "
                                                  "member, so that all start from one model")
    weighting: Literal["staleness", "samples", "equal"] = Field(
        "staleness", description="how much each member's latest model counts: samples / (1 + cycles behind) "
        "(staleness), samples, or equal")
    sync: bool = Field(False, description="synchronous cycles (the CloudMesh report's code): the leader answers a "
                       "cycle once every living member pushed it (a member silent for the peer timeout is lost and "
                       "no longer waited for), every member with the same aggregate; false: each push is answered "
                       "at once with the latest models")
    fraction: float = Field(1.0, gt=0, le=1, description="with sync: the share of the members whose models make each "
                            "cycle's aggregate, drawn from the seed per cycle (FedAvg's; the others are still waited "
                            "for and answered)")
    secure: bool = Field(False, description="secure aggregation (with sync, at least 3 members): each member "
                         "masks its model with pairwise masks from key agreement, so the leader learns only each "
                         "cycle's weighted sum (docs/privacy.md)")
    central_dp: CentralDPSettings = Field(CentralDPSettings(), description=CENTRAL_DP_HELP)

    def drawn(self, members: int) -> int:
        """How many of ``members`` a synchronous cycle takes at ``fraction`` (``drawn``)."""
        return drawn(self.fraction, members)


class FedAvgSettings(Settings):
    """FedAvg's settings (flat names: ``fedavg_fraction``, ``fedavg_compress``, ``fedavg_fragments``,
    ``fedavg_overlap``, ``fedavg_mix``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"fraction": "fedavg_fraction", "cohort": "fedavg_cohort",
                                            "compress": "fedavg_compress", "fragments": "fedavg_fragments",
                                            "overlap": "fedavg_overlap", "mix": "fedavg_mix"}

    fraction: float = Field(1.0, gt=0, le=1, description="share of the nodes whose models the server takes each "
                            "round (drawn from the seed; DecentralizePy's working_fraction)")
    cohort: int = Field(0, ge=0, description="how many nodes the server takes each round, drawn from the seed as "
                        "with fedavg_fraction (0: fedavg_fraction says): a cross-device cohort of a population; the "
                        "batched engine keeps only the drawn clients' models, while they are drawn")
    compress: Literal["none", "int8", "int4"] = Field(
        "none", description="what travels: the model (none), or its change over the round (the pseudo-gradient, "
        "both ways) quantized to 8 or 4 bits a value with error feedback kept per node (as INTELLECT-1's int8)")
    fragments: int = Field(1, ge=1, le=1024, description="Streaming DiLoCo: the model in this many parts, part f "
                           "exchanged at iterations f, f + F, ...: each part synchronised every F iterations, "
                           "their offsets spread over them (needs fedavg_fraction 1)")

    overlap: bool = Field(False, description="Streaming DiLoCo's overlap: each iteration's exchange goes on while "
                          "the next iteration's local steps run, and its outcome (after any outer step) is mixed into "
                          "the part as trained meanwhile (needs fedavg_fraction 1)")
    mix: float = Field(0.5, ge=0, le=1, description="with overlap: the share of its own part, as trained meanwhile, a "
                       "node keeps when the exchange's outcome comes (Streaming DiLoCo's alpha)")

    def drawn(self, nodes: int) -> int:
        """How many of ``nodes`` a round takes: ``cohort`` (at most all of them), or at ``fraction``
        (``drawn``)."""
        return min(self.cohort, nodes) if self.cohort else drawn(self.fraction, nodes)

    @model_validator(mode="after")
    def _every_node_with_fragments(self) -> "FedAvgSettings":
        if self.cohort and self.fraction < 1:
            raise ValueError("give fedavg_cohort (a count) or fedavg_fraction (a share), not both")
        for name, asked in (("fedavg_fragments", self.fragments > 1), ("fedavg_overlap", self.overlap)):
            if asked and (self.fraction < 1 or self.cohort):
                raise ValueError(f"{name} needs fedavg_fraction 1 (every node trains every iteration, and takes "
                                 "each exchange's outcome)")
        return self


def drawn(fraction: float, members: int) -> int:
    """How many of ``members`` a ``fraction``'s draw takes (FedAvg's, at least one)."""
    from meshlearn.sharing.base import share_count

    return share_count(fraction, members)
