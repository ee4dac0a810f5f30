"""What a run folder's config.yaml tells its report: the config itself, the engine, a title for the
figures, and whether the aggregation rule's refusals point at attackers."""

from __future__ import annotations

from pathlib import Path

import yaml

from meshlearn.errors import ConfigError


def run_config(output: Path) -> dict:
    """A run folder's resolved config.yaml as a dict ({} if there is none, or it is unreadable)."""
    try:
        config = yaml.safe_load((Path(output) / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


def run_engine(output: Path) -> str:
    """The engine a run folder's config.yaml names (process if it names none)."""
    return str(run_config(output).get("engine", "process"))


def judges_peers(output: Path) -> bool:
    """Whether a run's aggregation rule is robust, so that the peers its nodes refused or found
    deviant point at attackers (under the mean, a bad model spreads and honest peers get refused
    too). A rule this process does not know (a user's) counts as robust."""
    # loads torch: not for a report that needs no rule
    from meshlearn.aggregation import get_rule

    try:
        return get_rule(str(run_config(output).get("aggregation", "mean"))).robust
    except ConfigError:
        return True


def run_title(output: Path) -> str:
    """A short name for a run's plots: its folder's name, with the algorithm and node count from
    its config.yaml when that is there (``demo (dpsgd, 6 nodes)``)."""
    output = Path(output)
    name = output.resolve().name or str(output)
    config = run_config(output)
    if not config.get("algorithm") or not config.get("nodes"):
        return name
    return f"{name} ({config['algorithm']}, {config['nodes']} nodes)"
