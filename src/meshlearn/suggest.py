"""Which known name a mistyped one meant: one ranking for flags, commands and the values of a setting
(``--iter`` -> ``--iterations``, ``simulte`` -> ``simulate``, ``gosip`` -> ``gossip``)."""

from __future__ import annotations

from collections.abc import Sequence

MIN_PREFIX = 2  # characters a word needs before it counts as the start of a longer name
TYPOS_PER = 3  # one typo forgiven per this many characters of the word (at least one)


def closest(word: str, candidates: Sequence[str]) -> str | None:
    """The candidate ``word`` most likely meant, or None. Ranked: one that ``word`` starts (``iter`` ->
    ``iterations``), then the nearest within a few typos (``gosip`` -> ``gossip``), then one whose last
    part ``word`` is (``port`` -> ``base-port``), then one whose start is within a few typos (``itra``
    -> ``iterations``). Case and leading dashes are ignored; ties go to the earlier candidate, so
    callers list the likeliest (the common flags) first."""
    key = _bare(word)
    if not key:
        return None
    typos = max(1, len(key) // TYPOS_PER) if len(key) >= MIN_PREFIX else 0  # one letter: only itself
    ranked = []
    for order, candidate in enumerate(candidates):
        name = _bare(candidate)
        if name == key:
            return candidate
        if len(key) >= MIN_PREFIX and name.startswith(key):
            ranked.append((0, 0, order, candidate))
        elif (distance := edit_distance(key, name)) <= typos:
            ranked.append((1, distance, order, candidate))
        elif len(key) > MIN_PREFIX and name.endswith("-" + key):
            ranked.append((2, 0, order, candidate))
        elif len(key) > MIN_PREFIX and (distance := edit_distance(key, name[:len(key)])) <= typos:
            ranked.append((3, distance, order, candidate))
    return min(ranked)[3] if ranked else None


def did_you_mean(word: str, candidates: Sequence[str]) -> str:
    """``"did you mean X? "`` for the candidate ``closest`` finds, or ``""`` (none, or ``word`` is one):
    the start of a hint."""
    found = closest(word, candidates)
    return f"did you mean {found}? " if found and _bare(found) != _bare(word) else ""


def edit_distance(a: str, b: str) -> int:
    """Insertions, deletions, substitutions and swaps of two neighbours that turn ``a`` into ``b``."""
    before, row = None, list(range(len(b) + 1))
    for i, char in enumerate(a, 1):
        current = [i]
        for j, other in enumerate(b, 1):
            cost = min(row[j] + 1, current[j - 1] + 1, row[j - 1] + (char != other))
            if before is not None and i > 1 and j > 1 and char == b[j - 2] and a[i - 2] == other:
                cost = min(cost, before[j - 2] + 1)
            current.append(cost)
        before, row = row, current
    return row[-1]


def _bare(name: str) -> str:
    return name.lstrip("-").lower().replace("_", "-")
