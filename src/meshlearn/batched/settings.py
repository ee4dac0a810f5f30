"""The batched engine's settings. Kept apart from the engine (no torch here), so a configuration is
validated, and the command line answers, without loading it."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from meshlearn.settings import Settings


class BatchedSettings(Settings):
    """How the batched engine trains its nodes and models time (flat names: ``batched_vectorize``,
    ``batched_chunk``, ``step_time``, ``bandwidth_gbps``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"vectorize": "batched_vectorize", "chunk": "batched_chunk"}

    vectorize: Literal["auto", "on", "off"] = Field(
        "auto", description="train the nodes in one vectorized call (torch.func.vmap: on) or one after another "
        "(off); auto: vectorized, except models with convolutions on the CPU, where one node at a time is "
        "faster (benchmarks/RESULTS.md)")
    chunk: int = Field(0, ge=0, description="nodes per vectorized call, to bound memory (0 = all at once)")
    step_time: float = Field(0.0, ge=0, description="modelled seconds of one node's local SGD step (0 = "
                             "measured on the first steps, one node alone)")
    bandwidth_gbps: float = Field(1.0, gt=0, description="modelled bandwidth of every link, in Gbit/s")
