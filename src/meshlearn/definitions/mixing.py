"""Several exchanges with the neighbours per iteration (``mixing_steps``), optionally accelerated:
multi-step gossip as DeTAG takes it (Lu and De Sa 2021, "Optimal complexity in decentralized
training", ICML; its accelerated gossip is Liu and Morse 2011, "Accelerated linear iterations for
distributed averaging").

A synchronous algorithm averages its payload (the model, or the model with its tracker) with its
neighbours once an iteration: ``W p``. With ``mixing_steps`` K it is averaged K times, ``W^K p``,
before the algorithm's merge takes it; its local steps, its payload and its merge are its own, so
gradient tracking with K steps is DeTAG's multi-consensus tracking. On a ring of 16 (second
eigenvalue of the weights 0.95) one exchange shrinks the nodes' disagreement by 5%; K exchanges
shrink it by ``0.95^K``. ``mixing_accelerated`` runs Chebyshev-style accelerated gossip instead,
``p_{k+1} = (1 + η) W p_k - η p_{k-1}`` with ``p_{-1} = p_0`` and ``η = (1 - sqrt(1 - λ²)) / (1 +
sqrt(1 - λ²))``, λ the weights' second largest eigenvalue in magnitude: it keeps the average and
shrinks every other component by ``sqrt(η)`` a step (0.72 on that ring, 0.95 plain).

What it costs and assumes: K times the messages and bytes an iteration (the run log counts every
exchange); the acceleration needs symmetric weights on a static graph (λ is worked out once, from
the dense weight matrix: at most ``MAX_SPECTRUM_NODES`` nodes), every message whole (TCP) and the
mean (a robust rule is not linear; a message missed makes that step's weights another matrix,
whose spectrum λ does not bound). No torch at import: the configuration checks a run against
``mixing_refusal`` before torch loads."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from meshlearn.definitions.base import DEFINITIONS, Exchange, RoundAlgorithm, State, definition
from meshlearn.errors import ConfigError
from meshlearn.settings import Settings
from meshlearn.topology.sampling import Round, StaticRounds

if TYPE_CHECKING:
    from torch import Tensor

MAX_SPECTRUM_NODES = 4096  # the accelerated steps' λ comes from a dense eigendecomposition of the weights


class MixingSettings(Settings):
    """How many exchanges with the neighbours an iteration holds, and whether they are accelerated
    (flat names: ``mixing_steps``, ``mixing_accelerated``)."""

    FLAT_NAMES: ClassVar[dict[str, str]] = {"steps": "mixing_steps", "accelerated": "mixing_accelerated"}

    steps: int = Field(1, ge=1, le=1000, description="exchanges with the neighbours per iteration (a synchronous "
                       "algorithm that averages with them once: dpsgd, tracking, gtadam, dadam, qgdsgdm, pushsum): "
                       "its payload is averaged this many times before its merge takes it (DeTAG's multi-step "
                       "gossip); each costs a round of messages")
    accelerated: bool = Field(False, description="with mixing_steps 2 or more: accelerated gossip, p <- (1+η) W p - "
                              "η p_previous with η from the weights' second eigenvalue, which shrinks the nodes' "
                              "disagreement by sqrt(η) a step instead of that eigenvalue (a static graph, symmetric "
                              "weights, transport tcp, aggregation mean)")


def mixing_refusal(algorithm: str, mixing: MixingSettings, run: Any) -> str | None:
    """Why a run's settings ``run`` (an experiment's: algorithm, sharing, aggregation, transport,
    its ``dynamic()`` topology) cannot take ``mixing``, in one line naming what to change; or None."""
    if mixing.steps == 1:
        return "mixing_accelerated needs mixing_steps 2 or more (e.g. 10)" if mixing.accelerated else None
    found = definition(algorithm)
    if not repeatable(found):
        names = ", ".join(name for name in DEFINITIONS.names() if repeatable(definition(name)))
        return (f"mixing_steps {mixing.steps} repeats an exchange with the neighbours, which algorithm {algorithm} "
                f"does not make once an iteration: use one that does ({names}), or mixing_steps 1")
    if run.sharing != "full":
        return (f"mixing_steps {mixing.steps} averages whole payloads: use sharing full (not {run.sharing}), or "
                "mixing_steps 1")
    if not mixing.accelerated:
        return None
    dynamic = run.dynamic()
    for problem, fix in ((dynamic, "a static topology"), (run.transport != "tcp", "transport tcp"),
                         (run.aggregation != "mean", "aggregation mean")):
        if problem:
            return f"mixing_accelerated needs {fix} (its step comes from one symmetric weight matrix): " \
                   f"change it, or mixing_accelerated false"
    return None


def repeatable(found: type) -> bool:
    """Whether an algorithm's exchange can be repeated: a ``RoundAlgorithm`` with one exchange an
    iteration, with its neighbours, merging their weighted sum, not overlapped with its steps."""
    return isinstance(found, type) and issubclass(found, RoundAlgorithm) and found.phases == 1 and \
        found.talks_to == "neighbours" and found.linear


def with_mixing(rules: RoundAlgorithm, mixing: MixingSettings | None) -> Any:
    """``rules`` as the engines run it under ``mixing``: itself for one step, else ``RepeatedMixing``."""
    if mixing is None or mixing.steps == 1:
        return rules
    return RepeatedMixing(rules, mixing)


def second_eigenvalue(exchange: Round) -> float:
    """The second largest eigenvalue in magnitude of a round's weight matrix (each node's own
    weight what its senders leave of one); ConfigError where the weights are not symmetric or the
    graph is too large to decompose."""
    import numpy as np

    nodes = len(exchange.weights)
    if nodes > MAX_SPECTRUM_NODES:
        raise ConfigError(f"mixing_accelerated works out the weights' spectrum densely, for at most "
                          f"{MAX_SPECTRUM_NODES} nodes ({nodes} here): use mixing_accelerated false")
    matrix = np.zeros((nodes, nodes))
    for i, row in enumerate(exchange.weights):
        for j, weight in row.items():
            matrix[i, j] = weight
        matrix[i, i] += 1.0 - sum(row.values())
    if not np.allclose(matrix, matrix.T, rtol=0, atol=1e-12):
        raise ConfigError("mixing_accelerated needs symmetric weights (Metropolis-Hastings on an undirected graph): "
                          "use mixing_accelerated false")
    magnitudes = np.sort(np.abs(np.linalg.eigvalsh(matrix)))
    return float(magnitudes[-2]) if nodes > 1 else 0.0


def acceleration(second: float) -> float:
    """The accelerated gossip's ``η`` for weights whose second eigenvalue in magnitude is
    ``second`` (ConfigError for a graph that does not mix: not connected, or bipartite with no
    weight on a node's own model)."""
    if second >= 1.0 - 1e-9:
        raise ConfigError("mixing_accelerated needs a graph whose weights mix (connected, some weight on each node's "
                          "own model): this one's second eigenvalue is 1")
    root = math.sqrt(1.0 - second * second)
    return (1.0 - root) / (1.0 + root)


class RepeatedMixing:
    """A ``RoundAlgorithm`` whose one exchange an iteration is made ``steps`` times (see the
    module): the engines see ``steps`` phases. Phase 0 sends the definition's payload; every later
    phase sends the mix the phase before made (plain, or accelerated); the last phase's mix goes to
    the definition's merge. Every other call goes to the definition itself. Payload-sized buffers,
    made at the first iteration and reused: the mix so far and (accelerated) the one before it;
    what a later phase sends is a copy of its own (an engine may write its sum into what it sent,
    and the process engine's transport may still be sending it when the next phase begins)."""

    def __init__(self, rules: RoundAlgorithm, mixing: MixingSettings):
        if not repeatable(type(rules)) or rules.overlaps:
            raise ConfigError(f"mixing_steps {mixing.steps} repeats an exchange with the neighbours, which algorithm "
                              f"{rules.name} does not make once an iteration: use mixing_steps 1")
        self.rules, self.phases = rules, mixing.steps
        self.momentum = acceleration(second_eigenvalue(self._static_round(rules))) if mixing.accelerated else 0.0
        self._mix: Tensor | None = None  # p_k
        self._before: Tensor | None = None  # p_{k-1}

    @staticmethod
    def _static_round(rules: RoundAlgorithm) -> Round:
        if not isinstance(rules.rounds, StaticRounds):
            raise ConfigError("mixing_accelerated needs a static topology: use mixing_accelerated false")
        return rules.round(0)

    def __getattr__(self, name: str) -> Any:
        if name == "rules":  # not yet set (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.rules, name)

    def exchange(self, iteration: int, phase: int = 0) -> Exchange:
        """The definition's one exchange of ``iteration``, numbered ``phase``."""
        return dataclasses.replace(self.rules.exchange(iteration, 0), phase=phase)

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """Phase 0: the definition's payload (kept as the first mix); later: the mix so far."""
        if exchange.phase == 0:
            sent = self.rules.payload(own, state, exchange)
            if self._mix is None or self._mix.shape != sent.shape:
                self._mix = sent.new_empty(sent.shape)
                self._before = sent.new_empty(sent.shape) if self.momentum else None
            self._mix.copy_(sent)
            if self.momentum:
                self._before.copy_(sent)
            return sent
        return self._mix.clone()  # a tensor of its own: a transport may still be sending the last one

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """The next mix from ``mixed`` (``W p_k``); at the last phase the definition's merge takes it."""
        if self.momentum:  # p_{k+1} = (1 + η) W p_k - η p_{k-1} = p_{k-1} + (1 + η)(W p_k - p_{k-1}), one pass
            following = self._before.lerp_(mixed, 1.0 + self.momentum)
            self._before, self._mix = self._mix, following
        else:
            self._mix.copy_(mixed)
        if exchange.phase == self.phases - 1:
            self.rules.merge(own, state, self._mix, dataclasses.replace(exchange, phase=0))

    merge_stack = RoundAlgorithm.merge_stack  # the weighted sum of what came, into ``merge`` (the definition is linear)
