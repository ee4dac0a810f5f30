"""Gossip's declaration (dpwa). Its runtimes drive one per-node state machine,
``definitions.gossipstate.GossipState``: ``node.algorithms.gossip.GossipAverager`` (process
engine, and the adapter) and ``batched.algorithms.gossip``."""

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import GossipSettings


@register_algorithm
class GossipDefinition(Definition):
    """Asynchronous pairwise averaging: fetch a random neighbour's model and interpolate."""

    name = "gossip"
    summary = "asynchronous pairwise averaging, as dpwa"
    needs = Needs(endpoint="pull", synchronous=False, robust=True, byzantine=True, network=True, outer=True)
    settings = GossipSettings
