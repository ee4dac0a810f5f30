"""JSONL event logs: what every node writes and every report reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator


class JsonlLog:
    """One JSON object per line, flushed as it goes so a crash loses little. The first write of a
    log starts the file afresh (a rerun into the same folder must not append to the last run),
    unless ``append`` (a resumed run, whose log ``truncate_log`` cut back to its checkpoint)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._file = None
        self._opened = append

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


def truncate_log(path: str | Path, iteration: int) -> None:
    """Cut a run log back to what it held once ``iteration`` iterations were done (a run resumed
    from its checkpoint of then writes the rest again): its iteration events before ``iteration``,
    its evaluations up to it, no final event; the file is replaced whole, never left half cut."""
    path = Path(path)
    kept = []
    for event in read_jsonl(path):
        kind, at = event.get("event"), event.get("iteration")
        if kind == "final" or (kind == "iteration" and isinstance(at, int) and at >= iteration) or \
                (kind in ("eval", "resumed") and isinstance(at, int) and at > iteration):
            continue
        kept.append(json.dumps(event, separators=(",", ":")) + "\n")
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text("".join(kept), encoding="utf-8")
    os.replace(partial, path)


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


class LogTail:
    """Reads a run's logs folder while the run writes it: each ``read()`` returns the per-node
    events (columnar ones expanded) of the complete lines written since the last call. A log that
    is started afresh (a rerun into the same folder) is read again from its start."""

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        self._offsets: dict[Path, tuple[int, int]] = {}  # path -> (inode, bytes read)

    def read(self) -> list[dict[str, Any]]:
        """New events of every node log and of the columnar log, in file order per log."""
        events: list[dict[str, Any]] = []
        paths = sorted(self.folder.glob("node_*.jsonl")) + [self.folder / COLUMNAR_LOG]
        for path in paths:
            events += self._read_one(path)
        return events

    def _read_one(self, path: Path) -> list[dict[str, Any]]:
        try:
            with path.open("rb") as handle:
                stat = os.fstat(handle.fileno())
                inode, done = self._offsets.get(path, (stat.st_ino, 0))
                if inode != stat.st_ino or stat.st_size < done:
                    done = 0  # a new file in its place
                handle.seek(done)
                data = handle.read()
        except OSError:
            return []
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        self._offsets[path] = (stat.st_ino, done + end)
        rank = _rank_of(path)
        events = []
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if not isinstance(event, dict):
                continue
            for one in per_node(event):
                if rank is not None:
                    one.setdefault("rank", rank)
                events.append(one)
        return events


def _rank_of(path: Path) -> int | None:
    """The rank a per-node log belongs to (node_3.jsonl -> 3); None for the columnar log."""
    stem = path.stem
    return int(stem[5:]) if stem.startswith("node_") and stem[5:].isdigit() else None
