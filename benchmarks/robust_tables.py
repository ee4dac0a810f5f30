"""The honest-accuracy tables of `experiments/robust-aggregation.yaml` for RESULTS.md: attack x
rule, mean over seeds (min-max), the best rule against the clean `mean`, and the suspects seen.

    meshlearn experiment experiments/robust-aggregation.yaml --quick --output runs/robust
    python benchmarks/robust_tables.py runs/robust
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

ATTACKS = ("none", "sign-flip", "gaussian", "label-flip", "stale", "alie")
GROUPS = {"": "3-regular, seeds 1, 2, 3", "hm-": "3-regular, seeds 2, 4, 6 (an honest majority everywhere)",
          "deg6-": "6-regular, seeds 1, 2, 3"}
RULE_ORDER = ("mean", "median", "trimmed-mean", "krum", "clip", "clip-nearest", "filter")


def load(folder: Path) -> dict[tuple[str, str, str], list[tuple[int, float, str]]]:
    """(group prefix, attack, rule) -> [(seed, honest accuracy, suspected nodes)]."""
    cells = defaultdict(list)
    for run in sorted(p for p in folder.iterdir() if (p / "summary.json").is_file()):
        match = re.fullmatch(r"(hm-|deg6-)?(none|sign-flip|gaussian|label-flip|stale|alie)-(.+)-s(\d+)", run.name)
        if not match:
            continue
        prefix, attack, rule, seed = match.groups()
        summary = json.loads((run / "summary.json").read_text())
        suspects = "+".join(sorted(summary.get("suspected", {}), key=int)) or "none"
        cells[(prefix or "", attack, rule)].append((int(seed), 100 * summary["final"]["accuracy"], suspects))
    return cells


def rule_label(rule: str) -> str:
    return rule.replace("clip-nearest", "clip:nearest").replace("trimmed-mean", "trimmed-mean:").replace(
        "krum", "krum:").replace("::", ":")


def table(cells, prefix: str, seeds: set[int] | None = None) -> str:
    rules = sorted({r for (p, _, r) in cells if p == prefix},
                   key=lambda r: next(i for i, name in enumerate(RULE_ORDER) if r.startswith(name.split("-")[0]) and
                                      (r == "clip-nearest") == (name == "clip-nearest")))

    def values(attack, rule):
        return [a for s, a, _ in cells.get((prefix, attack, rule), []) if seeds is None or s in seeds]

    clean = statistics.fmean(values("none", "mean"))
    lines = ["| attack | " + " | ".join(rule_label(r) for r in rules) + " | best rule - clean mean |",
             "|---|" + "---:|" * (len(rules) + 1)]
    for attack in ATTACKS:
        row, best = [], None
        for rule in rules:
            got = values(attack, rule)
            if not got:
                row.append("")
                continue
            mean = statistics.fmean(got)
            row.append(f"{mean:.1f} ({min(got):.1f}-{max(got):.1f})" if len(got) > 1 else f"{mean:.1f}")
            if attack != "none" and (best is None or mean > best[0]):
                best = (mean, rule)
        if attack == "none":
            gaps = "; ".join(f"{rule_label(r)} {statistics.fmean(values('none', r)) - clean:+.1f}"
                             for r in rules if r != "mean" and values("none", r))
        else:
            gaps = f"{best[0] - clean:+.1f} ({rule_label(best[1])})"
        lines.append(f"| {attack} | " + " | ".join(row) + f" | {gaps} |")
    suspects = defaultdict(set)
    for (p, attack, rule), runs in cells.items():
        if p == prefix and rule != "mean":
            suspects[attack].update(s for seed, _, s in runs if seeds is None or seed in seeds)
    lines.append("")
    lines.append("Suspected (robust rules; the sets seen): " +
                 "; ".join(f"{a}: {', '.join(sorted(suspects[a]))}" for a in ATTACKS if suspects[a]) + ".")
    return "\n".join(lines)


def main(folder: str) -> None:
    cells = load(Path(folder))
    for prefix, title in GROUPS.items():
        if any(p == prefix for p, _, _ in cells):
            print(f"{title}:\n\n{table(cells, prefix)}\n")
    print("3-regular, seeds 1 and 3 only (a bad majority around one honest node):\n")
    print(table(cells, "", {1, 3}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/robust-aggregation-quick")
