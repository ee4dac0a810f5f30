"""The node runtime: one participant of a run, hostable many to a process."""

from meshlearn.evaluation import evaluate_model
from meshlearn.metrics import Evaluation
from meshlearn.node.factory import build_node, load_run_dataset, make_transport
from meshlearn.node.node import Node

__all__ = ["Evaluation", "Node", "build_node", "evaluate_model", "load_run_dataset", "make_transport"]
