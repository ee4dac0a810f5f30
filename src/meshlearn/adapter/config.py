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
while this worker trains (see ``meshlearn.node.algorithms.gossip``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, ClassVar

import yaml
from pydantic import Field, field_validator, model_validator

from meshlearn.definitions.settings import GossipSettings
from meshlearn.errors import ConfigError
from meshlearn.settings import Settings

# dpwa's name of each gossip setting (timeout_ms is in milliseconds; the engine's timeout in seconds)
DPWA_NAMES = {"fetch_probability": "fetch_probability", "timeout_ms": "timeout", "interpolation": "interpolation",
              "divergence_threshold": "divergence_threshold", "constant": "value", "fresh": "fresh"}
DPWA_SECTIONS = ("clock", "loss")  # dpwa lists these method sections; they carry no settings


class PeerAddress(Settings):
    """One worker of the group: its name and where its endpoint listens."""

    name: str = Field(min_length=1)
    host: str = Field(min_length=1)
    port: int = Field(ge=1, le=65535)


class GossipConfig(Settings):
    """Every worker of a group, and how they average (``GossipSettings``, written with dpwa's names)."""

    NAMES: ClassVar[dict[str, str]] = {engine: dpwa for dpwa, engine in DPWA_NAMES.items()}

    nodes: list[PeerAddress] = Field(min_length=1)
    gossip: GossipSettings = GossipSettings()

    @model_validator(mode="before")
    @classmethod
    def _dpwa_names(cls, values: Any) -> Any:
        if not isinstance(values, dict):
            return values
        values = {k: v for k, v in values.items() if k not in DPWA_SECTIONS}
        if isinstance(values.get("nodes"), list):
            values["nodes"] = [_known_node_keys(node) for node in values["nodes"]]
        gossip = dict(values.pop("gossip", None) or {})
        for dpwa, engine in DPWA_NAMES.items():
            if dpwa not in values:
                continue
            value = values.pop(dpwa)
            if dpwa == "timeout_ms" and isinstance(value, (int, float)) and not isinstance(value, bool):
                value = value / 1000
            if dpwa == "constant" and isinstance(value, dict):
                if set(value) != {"value"}:
                    raise ValueError("constant must be a number or {value: NUMBER}")
                value = value["value"]
            gossip[engine] = value
        return {**values, "gossip": gossip}

    @field_validator("nodes")
    @classmethod
    def _unique_names(cls, nodes: list[PeerAddress]) -> list[PeerAddress]:
        names = [node.name for node in nodes]
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        return nodes

    @classmethod
    def setting_name(cls, loc: tuple) -> str:
        """A gossip setting by the name dpwa's file gives it."""
        if len(loc) >= 2 and loc[0] == "gossip":
            return cls.NAMES.get(str(loc[1]), str(loc[1]))
        return super().setting_name(loc)

    def settings(self) -> GossipSettings:
        """The averaging settings the engine uses."""
        return self.gossip

    def rank_of(self, name: str) -> int:
        """The index of worker ``name`` in ``nodes`` (its node id)."""
        for rank, node in enumerate(self.nodes):
            if node.name == name:
                return rank
        raise ConfigError(f"no node named {name!r} in the config (nodes: {', '.join(n.name for n in self.nodes)})")


def _known_node_keys(node: Any) -> Any:
    """A node entry without keys dpwa would ignore (``gpu: 0``, ...), with a warning for each."""
    if not isinstance(node, dict):
        return node
    extra = sorted(set(node) - set(PeerAddress.model_fields), key=str)
    for key in extra:
        warnings.warn(f"gossip config: node {node.get('name', '?')!r}: unknown key {key!r} ignored "
                      f"(a node has name, host and port)", UserWarning, stacklevel=3)
    return {k: v for k, v in node.items() if k not in extra}


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
        return GossipConfig(**{str(k): v for k, v in source.items()})
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
