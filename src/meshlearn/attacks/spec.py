"""``byzantine:`` settings: which nodes misbehave and how, checked without torch."""

from __future__ import annotations

from dataclasses import dataclass

from meshlearn.errors import ConfigError
from meshlearn.suggest import did_you_mean

# behaviour -> (its argument's name, default; None: it takes none)
BEHAVIOURS: dict[str, tuple[str, float] | None] = {
    "sign-flip": ("SCALE", 1.0), "gaussian": ("STD", 1.0), "scale": ("S", 10.0), "label-flip": None,
    "stale": None, "alie": ("Z", 1.0),
}
BYZANTINE_HELP = ("bad nodes, RANK:BEHAVIOUR[:ARG],...: sign-flip[:SCALE] (sends -SCALE x its model), gaussian[:STD] "
                  "(random noise), scale[:S], label-flip (trains on flipped labels), stale (keeps sending its first "
                  "model), alie[:Z] (A little is enough: neighbours' mean - Z x their std); e.g. 3:sign-flip:10")


@dataclass(frozen=True)
class ByzantineSpec:
    """One bad node's behaviour and its argument."""

    behaviour: str
    arg: float | None = None

    def __str__(self) -> str:
        return self.behaviour if self.arg is None else f"{self.behaviour}:{self.arg:g}"


def parse_byzantine(text: str, nodes: int | None = None) -> dict[int, ByzantineSpec]:
    """``"3:sign-flip:10,5:stale"`` -> {3: sign-flip 10, 5: stale}; ConfigError naming the bad item
    (an unknown behaviour, a bad argument, a rank twice or not below ``nodes``)."""
    found: dict[int, ByzantineSpec] = {}
    for item in filter(None, (part.strip() for part in str(text).split(","))):
        rank_text, _, rest = item.partition(":")
        behaviour, _, arg_text = rest.partition(":")
        if not rank_text.strip().isdigit() or behaviour not in BEHAVIOURS:
            raise _refused(text, item, f"{did_you_mean(behaviour, list(BEHAVIOURS))}write RANK:BEHAVIOUR[:ARG] with "
                           f"BEHAVIOUR one of {', '.join(BEHAVIOURS)} (e.g. 3:sign-flip:10)")
        rank = int(rank_text)
        if rank in found or (nodes is not None and rank >= nodes):
            raise _refused(text, item, f"node {rank} " + ("is named twice" if rank in found else
                                                          f"does not exist (nodes 0..{nodes - 1})"))
        takes = BEHAVIOURS[behaviour]
        if takes is None:
            if arg_text:
                raise _refused(text, item, f"{behaviour} takes no argument")
            found[rank] = ByzantineSpec(behaviour)
            continue
        try:
            arg = float(arg_text) if arg_text else takes[1]
        except ValueError:
            raise _refused(text, item, f"{takes[0]} must be a number") from None
        found[rank] = ByzantineSpec(behaviour, arg)
    return found


def _refused(text: str, item: str, problem: str) -> ConfigError:
    """The error for one bad ``item`` of the setting ``text`` (the item named where there are others)."""
    text = str(text).strip()
    return ConfigError(problem if item == text else f"{item!r}: {problem}", setting="byzantine", value=text)
