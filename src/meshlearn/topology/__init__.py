"""Topologies: graphs, seeded generators, DecentralizePy graph files, mixing weights."""

from meshlearn.topology.files import read_graph_file, write_graph_file
from meshlearn.topology.generators import (
    build_topology,
    erdos_renyi,
    fully_connected,
    regular,
    ring,
    small_world,
    star,
    torus,
)
from meshlearn.topology.graph import Graph
from meshlearn.topology.weights import metropolis_hastings, mh_row

__all__ = [
    "Graph", "build_topology", "erdos_renyi", "fully_connected", "metropolis_hastings", "mh_row",
    "read_graph_file", "regular", "ring", "small_world", "star", "torus", "write_graph_file",
]
