"""Rounds and exchanges by hand, for tests of a ``RoundAlgorithm``'s rules over stacks."""

import torch

from meshlearn.definitions.base import RoundAlgorithm
from meshlearn.topology.sampling import Round


class Fixed:
    """Rounds that are the same directed round every iteration."""

    def __init__(self, send_to):
        n = len(send_to)
        self._round = Round(tuple(map(tuple, send_to)), tuple(tuple(i for i in range(n) if j in send_to[i])
                                                                    for j in range(n)),
                            tuple({i: 0.0 for i in range(n) if j in send_to[i]} for j in range(n)))

    def round(self, iteration):
        return self._round


def exchange(rule: RoundAlgorithm, own: torch.Tensor, state: dict, iteration: int) -> None:
    """One round of ``rule`` for every node, as an engine runs it: payloads out, each node's merge
    of the stack it received (every message arrives)."""
    exchange_ = rule.round(iteration)
    sent = rule.payload(own, state, iteration)
    width = max(len(s) for s in exchange_.receive_from)
    received = sent.new_zeros((len(own), width, sent.shape[1]))
    weights = torch.zeros(len(own), width, dtype=torch.float64)
    for i, senders in enumerate(exchange_.receive_from):
        for k, j in enumerate(senders):
            received[i, k] = sent[j]
            weights[i, k] = exchange_.weights[i][j]
    own_weight = torch.tensor(rule.own_weights(exchange_, list(range(len(own)))), dtype=torch.float64)
    rule.merge_stack(own, state, sent, received, weights, own_weight, iteration)
