"""The adapter's configuration: dpwa's YAML format unchanged, or an equivalent meshlearn YAML.

dpwa's file is a list of one-key maps::

    - nodes:
      - {name: w1, host: localhost, port: 45000}
    - fetch_probability: 1
    - timeout_ms: 2500
    - interpolation: constant   # clock | loss | constant
    - divergence_threshold: 0.2
    - constant: { value: 0.5 }
    - clock: 0                  # settings of the clock and loss methods: they have none
    - loss: 0

meshlearn's is the same keys as one map, and ``constant`` may be a plain number. Either may add
``fresh: false`` to fetch what a peer already has, as dpwa does, instead of the state it finishes
while this worker trains (see ``meshlearn.algorithms.gossip``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from meshlearn.algorithms.gossip import GossipSettings
from meshlearn.errors import ConfigError


class PeerAddress(BaseModel):
    """One worker of the group: its name and where its endpoint listens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class GossipConfig(BaseModel):
    """Every worker of a group and how they average."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: list[PeerAddress] = Field(min_length=1)
    fetch_probability: float = Field(1.0, ge=0, le=1)
    timeout_ms: float = Field(2500, gt=0)
    interpolation: Literal["constant", "clock", "loss"] = "constant"
    divergence_threshold: float = Field(0.0, ge=0)
    constant: float = Field(0.5, ge=0, le=1)
    fresh: bool = True
    clock: Any = None  # dpwa lists these method sections; they carry no settings
    loss: Any = None

    @field_validator("constant", mode="before")
    @classmethod
    def _constant_value(cls, value: Any) -> Any:
        if isinstance(value, dict):
            if set(value) != {"value"}:
                raise ValueError("must be a number or {value: NUMBER}")
            return value["value"]
        return value

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, nodes: list[PeerAddress]) -> list[PeerAddress]:
        names = [node.name for node in nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        return nodes

    def settings(self) -> GossipSettings:
        """The averaging settings the engine uses."""
        return GossipSettings(self.fetch_probability, self.timeout_ms / 1000, self.interpolation, self.constant,
                              self.divergence_threshold, self.fresh)

    def rank_of(self, name: str) -> int:
        """The index of worker ``name`` in ``nodes`` (its node id)."""
        for rank, node in enumerate(self.nodes):
            if node.name == name:
                return rank
        raise ConfigError(f"no node named {name!r} in the config (nodes: {', '.join(n.name for n in self.nodes)})")


def load_gossip_config(source: str | Path | dict | list | GossipConfig) -> GossipConfig:
    """A GossipConfig from a YAML file path, parsed YAML (dpwa's list or a map) or a GossipConfig."""
    if isinstance(source, GossipConfig):
        return source
    where = "gossip config"
    if isinstance(source, (str, Path)):
        path = Path(source)
        where = f"gossip config {path}"
        if not path.is_file():
            raise ConfigError(f"{where} does not exist")
        try:
            source = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            raise ConfigError(f"{where} is not valid YAML: fix its syntax") from None
    if isinstance(source, list):  # dpwa: a list of one-key maps
        merged: dict[str, Any] = {}
        for item in source:
            if not isinstance(item, dict) or len(item) != 1:
                raise ConfigError(f"{where}: each list entry must be a one-key map like '- timeout_ms: 2500'")
            key = next(iter(item))
            if key in merged:
                raise ConfigError(f"{where}: {key!r} is given twice")
            merged.update(item)
        source = merged
    if not isinstance(source, dict):
        raise ConfigError(f"{where} must be dpwa's list of one-key maps or a map of settings")
    try:
        return GossipConfig(**source)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(p) for p in error["loc"]) or "config"
        raise ConfigError(f"{where}: {field}: {error['msg']}") from None
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None
