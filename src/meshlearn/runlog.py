"""JSONL event logs: what every node writes and every report reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator


class JsonlLog:
    """One JSON object per line, flushed as it goes so a crash loses little. The first write of a
    log starts the file afresh (a rerun into the same folder must not append to the last run)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = None
        self._opened = False

    def write(self, event: dict[str, Any]) -> None:
        """Add one event."""
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a" if self._opened else "w", encoding="utf-8")
            self._opened = True
        self._file.write(json.dumps(event, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (writing again reopens it in append mode)."""
        if self._file is not None:
            self._file.close()
            self._file = None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """The events of a JSONL log; a torn last line (from a crash) is skipped."""
    with Path(path).open(encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except ValueError:
                continue


COLUMNAR_LOG = "nodes.jsonl"  # a run's one columnar log of every node, in its logs/ folder (batched engine)

# A columnar event holds one value per node for many nodes at once (the batched engine's one log
# for thousands of nodes): {"event": ..., "ranks": [r, ...], "columns": {field: [value per rank]},
# shared fields...}. ``per_node`` turns it into the per-node events a node's own log would hold.

def columnar_event(event: str, ranks: list[int], columns: dict[str, list[Any]], **shared: Any) -> dict[str, Any]:
    """One event of many nodes: ``columns`` hold one value per rank of ``ranks``, in that order."""
    for name, values in columns.items():
        if len(values) != len(ranks):
            raise ValueError(f"column {name!r} has {len(values)} values for {len(ranks)} nodes")
    return {"event": event, "ranks": list(ranks), "columns": columns, **shared}


def per_node(event: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-node events in a columnar event (or the event itself, if it is not columnar)."""
    if "columns" not in event or "ranks" not in event:
        return [event]
    shared = {key: value for key, value in event.items() if key not in ("ranks", "columns")}
    columns = event["columns"]
    return [{**shared, "rank": rank, **{name: values[index] for name, values in columns.items()}}
            for index, rank in enumerate(event["ranks"])]
