"""The node runtime: one participant of a run, hostable many to a process."""

from meshlearn.node.factory import build_node, make_transport
from meshlearn.node.node import Evaluation, Node, evaluate_model

__all__ = ["Evaluation", "Node", "build_node", "evaluate_model", "make_transport"]
