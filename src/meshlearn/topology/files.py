"""DecentralizePy graph files: first line the node count, then edges (`u v`) or adjacency lines."""

from __future__ import annotations

from pathlib import Path

from meshlearn.errors import TopologyError
from meshlearn.topology.graph import Graph

LAYOUTS = ("auto", "edges", "adjacency")


def _parse(path: Path) -> tuple[int, list[list[int]]]:
    if not path.is_file():
        raise TopologyError(f"graph file {path} does not exist: give the path of a DecentralizePy graph file")
    lines = path.read_text().splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        raise TopologyError(f"graph file {path} is empty: its first line must be the number of nodes")
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            rows.append([int(token) for token in line.split()])
        except ValueError:
            raise TopologyError(f"graph file {path}, line {number}: {line.strip()!r} is not whole numbers") from None
    if len(rows[0]) != 1 or rows[0][0] < 1:
        raise TopologyError(f"graph file {path}, line 1: must be the number of nodes alone")
    return rows[0][0], rows[1:]


def _as_edges(path: Path, n: int, rows: list[list[int]]) -> Graph:
    for number, row in enumerate(rows, start=2):
        if len(row) != 2:
            raise TopologyError(f"graph file {path}, line {number}: an edge line holds two node ids, got {len(row)}")
    try:
        return Graph(n, [(u, v) for u, v in rows])
    except TopologyError as exc:
        raise TopologyError(f"graph file {path}: {exc}") from None


def _as_adjacency(path: Path, n: int, rows: list[list[int]]) -> Graph:
    if len(rows) != n:
        raise TopologyError(f"graph file {path}: an adjacency file has one line per node ({n}), found {len(rows)}")
    sets = [set(row) for row in rows]
    for u, row in enumerate(sets):
        for v in row:
            if not 0 <= v < n or v == u or u not in sets[v]:
                raise TopologyError(
                    f"graph file {path}, line {u + 2}: neighbour {v} of node {u} is out of range, "
                    "the node itself, or not listed back (adjacency must be symmetric)"
                )
    return Graph(n, [(u, v) for u, row in enumerate(sets) for v in row])


def read_graph_file(path: str | Path, layout: str = "auto") -> Graph:
    """Read a graph file in either DecentralizePy layout; ``auto`` tells them apart when it can."""
    if layout not in LAYOUTS:
        raise TopologyError(f"unknown graph file layout {layout!r}: use one of {', '.join(LAYOUTS)}")
    path = Path(path)
    n, rows = _parse(path)
    if layout == "edges":
        return _as_edges(path, n, rows)
    if layout == "adjacency":
        return _as_adjacency(path, n, rows)
    readings, problems = [], []
    for reader in (_as_edges, _as_adjacency):
        try:
            readings.append(reader(path, n, rows))
        except TopologyError as exc:
            problems.append(str(exc))
    if not readings:
        raise TopologyError(problems[0])
    if len(readings) == 2 and readings[0] != readings[1]:
        raise TopologyError(
            f"graph file {path} reads as both an edge list and an adjacency list, giving different graphs: "
            "say which layout it is"
        )
    return readings[0]


def write_graph_file(graph: Graph, path: str | Path, layout: str = "edges") -> None:
    """Write a graph in DecentralizePy's edge (default) or adjacency layout."""
    if layout == "edges":
        body = [f"{u} {v}" for u, v in graph.edges()]
    elif layout == "adjacency":
        body = [" ".join(str(v) for v in graph.neighbours(u)) for u in range(graph.n)]
    else:
        raise TopologyError(f"unknown graph file layout {layout!r}: use edges or adjacency")
    Path(path).write_text("\n".join([str(graph.n), *body]) + "\n")
