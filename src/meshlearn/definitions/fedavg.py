"""FedAvg's declaration (McMahan et al. 2017). Its runtimes: ``algorithms.fedavg`` (process
engine) and ``batched.algorithms.fedavg``."""

from meshlearn.definitions.base import Definition, register_algorithm
from meshlearn.definitions.needs import Needs
from meshlearn.definitions.settings import FedAvgSettings


@register_algorithm
class FedAvgDefinition(Definition):
    """A parameter server (node 0) averages the drawn nodes' models by training samples."""

    name = "fedavg"
    summary = "a parameter server, node 0, averages by samples: the federated baseline; the topology is not used"
    needs = Needs(network=True)
    settings = FedAvgSettings
