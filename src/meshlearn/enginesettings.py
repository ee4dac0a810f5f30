"""The settings the engines own (the batched engine's section, ``batched:``). Kept out of the engine
packages, so the configuration validates them, and the command line answers, without importing an
engine (or torch)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from meshlearn.settings import Settings


class BatchedSettings(Settings):
    """How the batched engine trains its nodes and models time (flat names: ``batched_vectorize``,
    ``batched_chunk``; the others as they are)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"vectorize": "batched_vectorize", "chunk": "batched_chunk",
                                            "workers": "batched_workers", "client_memory": "batched_client_memory",
                                            "cohort": "batched_cohort"}

    vectorize: Literal["auto", "on", "off"] = Field(
        "auto", description="train the nodes in one vectorized call (torch.func.vmap: on) or one after another "
        "(off); auto: vectorized, except models with convolutions on the CPU, where one node at a time is "
        "faster (benchmarks/RESULTS.md)")
    chunk: int = Field(0, ge=0, description="nodes per vectorized call, to bound memory; 0 = auto: on the CPU, "
                       "as many as keep a call's activations within 128 MiB (gpt-tiny, batch 32: 1), on a GPU all at once")
    cohort: Literal["auto", "off"] = Field(
        "auto", description="auto: a FedAvg run whose clients keep nothing between rounds (no fedavg_compress, "
        "fragments or overlap; the mean; SGD) holds model rows for the server and a round's cohort only, made from "
        "the server's model when drawn, so memory follows the cohort, not the population; off: a row per node, "
        "as every other algorithm")
    client_memory: int = Field(
        512 * 2 ** 20, ge=0, description="bytes of what a population's clients keep between the rounds they are "
        "drawn for (their place in their batch stream, their momentum), held in memory when only a round's cohort "
        "has model rows (FedAvg's cohort path); beyond it the clients used longest ago go to files in the run "
        "folder's logs/clients/, removed when the run ends")
    workers: int = Field(0, ge=0, description="threads that train the nodes, each on one torch intra-op thread "
                         "(the count changes speed, never results); 0 = auto: on the CPU, times the run's first "
                         "steps on one worker and on one per core and keeps the faster; on a GPU, one")
    step_time: float = Field(0.0, ge=0, description="modelled seconds of one node's local SGD step (0 = from "
                             "step_cost)")
    step_cost: Literal["flops", "measured"] = Field(
        "flops", description="where a step's modelled time comes from when step_time is 0: flops (the model's "
        "counted FLOPs per step / device_gflops + step_overhead: the same on any machine and under any load), "
        "or measured (the fastest of a few steps of one node alone on this machine, which moves with its load; "
        "the run's config.yaml records what was measured as step_time)")
    device_gflops: float = Field(50.0, gt=0, description="modelled speed of every node's device for step_cost "
                                 "flops, in GFLOP/s (50: one 2026 CPU core on float32 CNNs, benchmarks/RESULTS.md)")
    step_overhead: float = Field(0.00025, ge=0, description="modelled seconds every step costs beside its FLOPs "
                                 "(step_cost flops): the framework's per-step work, which dominates tiny models")
    bandwidth_gbps: float = Field(1.0, gt=0, description="modelled bandwidth of every link, in Gbit/s (net's rate "
                                                         "replaces it where given)")
