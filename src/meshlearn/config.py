"""Typed, validated experiment configuration: every default lives here, and only here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from meshlearn.errors import ConfigError


class ExperimentConfig(BaseModel):
    """One decentralized training run: who trains what, on which graph, how they talk."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(8, ge=2, le=4096, description="number of nodes")
    topology: str = Field("regular:3", description="ring | torus | star | full | regular:D | smallworld:K:P | erdos:P | file:PATH")
    dataset: str = Field("digits", description="digits | fashion-mnist:PATH | mnist:PATH | cifar10:PATH | imagefolder:PATH")
    partition: str = Field("iid", description="iid | shards:K | dirichlet:ALPHA")
    model: str = Field("mlp", description="mlp | lenet | simplecnn | resnet18 | any registered model")
    algorithm: Literal["dpsgd", "gossip", "local"] = Field(
        "dpsgd", description="dpsgd (synchronous) | gossip (asynchronous pairwise, dpwa) | local (no exchange)")
    transport: Literal["tcp", "udp"] = "tcp"
    udp_mode: Literal["sync", "async"] = Field("sync", description="UDP: wait for all chunks (sync) or use what arrived (async)")
    udp_timeout: float = Field(0.4, gt=0, description="UDP sync mode: seconds to wait for neighbours' chunks")
    chunk_bytes: int = Field(0, ge=0, description="UDP payload bytes per datagram (0 = fit the path: 65456 on loopback, 1424 otherwise)")
    missing_chunks: Literal["per-chunk", "fill-local"] = Field("per-chunk", description="UDP: how lost chunks are averaged")
    late_chunks: Literal["use", "drop"] = Field(
        "use", description="UDP sync mode: chunks that miss their deadline fill the sender's missing chunks at the "
        "next iteration (use) or are dropped (drop, the UDP study's behaviour)")
    udp_rate_gbps: float = Field(2.0, gt=0, description="UDP sender pacing in GB/s")
    net: str = Field("", description="emulated network, e.g. loss=20%,corr=25%,delay=200ms,jitter=50ms")
    loss_mode: Literal["auto", "kernel", "user"] = Field(
        "auto", description="where net's loss is made: kernel (real drops in a network namespace; root + nftables), "
        "user (in the transport), auto (kernel for TCP where possible, user for UDP)")
    fetch_probability: float = Field(1.0, ge=0, le=1, description="gossip: chance of fetching a peer each iteration")
    fetch_timeout: float = Field(2.5, gt=0, description="gossip: seconds to wait for a fetch")
    interpolation: Literal["constant", "clock", "loss"] = Field("constant", description="gossip: how much of the peer to take")
    interpolation_value: float = Field(0.5, ge=0, le=1, description="gossip: the constant interpolation factor")
    divergence_threshold: float = Field(0.0, ge=0, description="gossip: below this loss take less of peers (0 = off)")
    fetch_fresh: bool = Field(True, description="gossip: ask a peer for the state it finishes while this node trains "
                                               "(false: the one it already has, as dpwa)")
    slowdown: str = Field("", description="emulated slow steps: RANK:FACTOR or RANK:+TIME, RANK may be *; "
                          "e.g. 0:3 (node 0 trains 3x slower) or *:+20ms,0:+60ms (sleep per step)")
    rounds: int = Field(1, ge=0, description="local SGD steps per iteration")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(0.05, gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    iterations: int = Field(100, ge=1)
    test_after: int = Field(10, ge=1, description="evaluate every this many iterations (and at the end)")
    eval_nodes: int = Field(0, ge=0, description="evaluate on the first N nodes only (0 = all)")
    eval_samples: int = Field(0, ge=0, description="evaluate on the first N test samples only (0 = all)")
    seed: int = Field(90, ge=0)
    wait_timeout: float = Field(60.0, gt=0, description="seconds to wait for neighbours' models each iteration")
    handshake_timeout: float = Field(60.0, gt=0, description="seconds to wait for every neighbour to say HELLO")
    max_message_mb: float = Field(512.0, gt=0, description="largest message accepted, in MiB")
    host: str = Field("127.0.0.1", description="address nodes listen on")
    base_port: int = Field(0, ge=0, le=65535, description="node r listens on base_port + r (0 = any free port)")
    device: str = Field("cpu", description="torch device for training: cpu | cuda | cuda:N | mps")
    threads: int = Field(1, ge=1, description="torch intra-op threads per node process")
    output: str | None = Field(None, description="results folder (default runs/<timestamp>)")

    @field_validator("topology", "dataset", "partition", "model", "host", "device")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value.strip()

    @field_validator("net")
    @classmethod
    def _valid_net(cls, value: str) -> str:
        from meshlearn.netem import NetemSpec

        return NetemSpec.parse(value).describe() if value.strip() else ""

    @field_validator("chunk_bytes")
    @classmethod
    def _valid_chunk(cls, value: int) -> int:
        if value and (value % 8 or value > 65_456):
            raise ValueError("must be 0 (auto) or a multiple of 8 up to 65456")
        return value

    @field_validator("slowdown")
    @classmethod
    def _valid_slowdown(cls, value: str) -> str:
        for item in filter(None, (part.strip() for part in value.split(","))):
            rank, sep, amount = item.partition(":")
            try:
                ok = bool(sep) and (rank == "*" or int(rank) >= 0) and _slowdown_amount(amount) is not None
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{item!r} is not RANK:FACTOR (>= 1, e.g. 0:3) or RANK:+TIME (e.g. *:+20ms)")
        return value.strip()

    @model_validator(mode="after")
    def _gossip_over_tcp(self) -> "ExperimentConfig":
        if self.algorithm == "gossip" and self.transport != "tcp":
            raise ValueError("gossip fetches peers' states over TCP: use transport tcp")
        return self

    def slowdown_of(self, rank: int) -> tuple[float, float]:
        """Node ``rank``'s emulated slowness: (factor on its step time, seconds added per step).
        An entry for the rank overrides one for ``*`` (every node)."""
        found = {}
        for item in filter(None, (part.strip() for part in self.slowdown.split(","))):
            r, _, amount = item.partition(":")
            found[r] = _slowdown_amount(amount)
        return found.get(str(rank), found.get("*", (1.0, 0.0)))

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * 1024 * 1024)

    def node_evaluates(self, rank: int) -> bool:
        """Whether node ``rank`` runs the periodic test evaluation."""
        return self.eval_nodes == 0 or rank < self.eval_nodes

    def to_yaml(self) -> str:
        """The resolved configuration as YAML (written next to every run's results)."""
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def _slowdown_amount(text: str) -> tuple[float, float] | None:
    """``3`` -> (3.0, 0.0); ``+20ms`` -> (1.0, 0.02); None if neither."""
    text = text.strip()
    if text.startswith("+"):
        number = text[1:].removesuffix("ms")
        seconds = float(number) / 1000 if text.endswith("ms") else float(text[1:].removesuffix("s"))
        return (1.0, seconds) if seconds >= 0 else None
    factor = float(text)
    return (factor, 0.0) if factor >= 1 else None


def _describe(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "config"
    got = err.get("input")
    shown = "" if isinstance(got, dict) else f" (got {got!r})"
    extra = "" if len(exc.errors()) == 1 else f" (and {len(exc.errors()) - 1} more problem(s))"
    if err["type"] == "extra_forbidden":
        return f"unknown setting {where!r}: remove it or check its spelling{extra}"
    if not err["loc"]:  # a rule across settings
        return err["msg"].removeprefix("Value error, ") + extra
    return f"setting {where!r}: {err['msg']}{shown}{extra}"


def make_config(values: dict[str, Any]) -> ExperimentConfig:
    """Validate plain values into an ExperimentConfig, or raise ConfigError with one clear line."""
    try:
        return ExperimentConfig(**values)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Plain values from a YAML experiment file (validated later by make_config)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist: give the path of a YAML experiment file")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: fix its syntax") from None
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings (key: value)")
    return {str(k).replace("-", "_"): v for k, v in values.items()}
