"""Topologies: generators, graph files, Metropolis-Hastings weights."""

import numpy as np
import pytest

from meshlearn.errors import TopologyError
from meshlearn.topology import (
    Graph, build_topology, metropolis_hastings, read_graph_file, ring, write_graph_file,
)

SPECS = ["ring", "torus", "star", "full", "regular:3", "regular:4", "smallworld:4:0.3", "erdos:0.4"]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [9, 12, 16])
def test_generators_connected_seeded_and_weights_doubly_stochastic(spec, n):
    if spec == "regular:3" and n % 2:
        pytest.skip("n*d must be even")
    graph = build_topology(spec, n, seed=5)
    assert graph.is_connected()
    assert build_topology(spec, n, seed=5) == graph
    w = metropolis_hastings(graph)
    assert np.allclose(w, w.T)
    assert np.allclose(w.sum(axis=1), 1.0)
    assert (w >= -1e-12).all()
    for i in range(n):
        for j in range(n):
            if i != j and j not in graph.neighbours(i):
                assert w[i, j] == 0


def test_degrees():
    assert all(build_topology("regular:3", 16, 1).degree(i) == 3 for i in range(16))
    assert all(build_topology("torus", 16, 1).degree(i) == 4 for i in range(16))
    assert build_topology("star", 6, 1).degree(0) == 5
    assert all(build_topology("full", 6, 1).degree(i) == 5 for i in range(6))


def test_random_generators_depend_on_seed():
    for spec in ("regular:3", "smallworld:4:0.5", "erdos:0.3"):
        graphs = {tuple(build_topology(spec, 16, seed).edges()) for seed in range(6)}
        assert len(graphs) > 1, spec


def test_mh_weight_values():
    graph = build_topology("star", 4, 0)  # centre degree 3, leaves degree 1
    w = metropolis_hastings(graph)
    assert w[0, 1] == pytest.approx(1 / 4)
    assert w[1, 1] == pytest.approx(3 / 4)
    assert w[0, 0] == pytest.approx(1 / 4)


@pytest.mark.parametrize("layout", ["edges", "adjacency"])
def test_graph_files_round_trip(tmp_path, layout):
    graph = build_topology("regular:3", 12, 2)
    path = tmp_path / "g.txt"
    write_graph_file(graph, path, layout)
    assert read_graph_file(path, layout) == graph
    assert read_graph_file(path) == graph  # auto-detected


def test_auto_detects_ring_edge_file(tmp_path):
    path = tmp_path / "ring.txt"
    write_graph_file(ring(5), path, "edges")  # 5 lines of two ids: could look like adjacency
    assert read_graph_file(path) == ring(5)


def test_ambiguous_file_needs_explicit_layout(tmp_path):
    # 4 nodes; as edges: 1-2, 0-3, 0-3, 1-2; as adjacency: 0:{1,2} 1:{0,3} 2:{0,3} 3:{1,2} (a 4-cycle)
    path = tmp_path / "g.txt"
    path.write_text("4\n1 2\n0 3\n0 3\n1 2\n")
    with pytest.raises(TopologyError, match="say which layout"):
        read_graph_file(path)
    assert read_graph_file(path, "adjacency").edges() == [(0, 1), (0, 2), (1, 3), (2, 3)]


def test_disconnected_and_bad_files_refused(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("4\n0 1\n2 3\n")
    with pytest.raises(TopologyError, match="disconnected"):
        build_topology(f"file:{path}", 4, 0)
    with pytest.raises(TopologyError, match="has 4 nodes but the run has 5"):
        build_topology(f"file:{path}", 5, 0)
    path.write_text("3\n0 x\n")
    with pytest.raises(TopologyError, match="line 2"):
        read_graph_file(path)
    with pytest.raises(TopologyError, match="does not exist"):
        read_graph_file(tmp_path / "missing.txt")


@pytest.mark.parametrize("spec, n, match", [
    ("hypercube", 8, "unknown topology"),
    ("regular:3", 7, "must be even"),
    ("regular:9", 8, "between 1 and 7"),
    ("regular:x", 8, "not a number"),
    ("torus", 7, "torus"),
    ("erdos:0", 8, r"\(0, 1\]"),
    ("smallworld:3:0.1", 8, "even"),
])
def test_bad_specs(spec, n, match):
    with pytest.raises(TopologyError, match=match):
        build_topology(spec, n, 0)


def test_graph_validation():
    with pytest.raises(TopologyError, match="self loop"):
        Graph(3, [(1, 1)])
    with pytest.raises(TopologyError, match="outside"):
        Graph(3, [(0, 3)])
    assert Graph(3, [(0, 1), (1, 0), (1, 2)]).edges() == [(0, 1), (1, 2)]
