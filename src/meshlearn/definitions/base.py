"""The algorithm layer's interface: an algorithm's declaration and, for a synchronous one, its
rules as functions over stacks of models, which both engines call.

A ``RoundAlgorithm`` gives each exchange of an iteration as a value (``exchange``: who talks to
whom, each node's weight on its own payload, what a payload that did not come means), what each
node sends (``payload``) and how a node merges its own model with what it received
(``merge_stack``); the engines pass the exchange to that exchange's calls, so no call depends on
one made before it. Its arguments are stacks: ``own`` [B, P] (the B nodes' models after their local steps), ``state``
(the algorithm's own per-node tensors, rows like ``own``), ``received`` [B, K, Q] (the payloads
that came in, padded), ``weights`` [B, K] (each one's weight, 0 where nothing came) and
``own_weight`` [B]. The process engine calls them with B = 1 for its node; the batched engine with
B = N for every node at once, and where the merge is the weighted sum (``linear``) it computes that
sum with one sparse product instead of stacking what each node received.

No torch import at module level: a configuration is checked against the declarations before torch
loads. The rules use tensor methods only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from meshlearn.definitions.needs import Needs
from meshlearn.errors import ConfigError
from meshlearn.plugins import Registry
from meshlearn.settings import Settings
from meshlearn.topology.sampling import Round, Rounds

if TYPE_CHECKING:
    from torch import Tensor

State = dict[str, "Tensor"]


@dataclass(frozen=True)
class Exchange:
    """One exchange of an iteration, as a ``RoundAlgorithm`` gives it (``exchange``) and both engines
    carry it out: ``round`` (whom each node sends to and hears from, each sender's weight), each of
    the definition's rows' weight on its own payload (``own_weights``, in the order of its
    ``ranks``), whether a sender not heard in time leaves its weight to the node's own payload
    (``keeps_missing``) and whether a node pools several senders' payloads in it (``pools``: the
    run's robust rule replaces the weighted sum there) or takes one sender's whole (FedAvg's
    answer: the weighted sum, whatever the rule). The engines hand it to the exchange's
    ``payload``, ``payload_problem``, ``merge`` and ``merge_stack``."""

    iteration: int
    phase: int  # of the iteration's exchanges (``phases``): 0, 1, ...
    round: Round
    own_weights: tuple[float, ...]
    keeps_missing: bool = True
    pools: bool = True


class Definition:
    """An algorithm as the layer below the engines knows it: its name, a one-line summary, what it
    needs (``Needs``), and the settings section it reads (None: no settings). The engines' own
    runtimes carry out the built-in asynchronous ones (gossip, leader) and those written before
    this layer; a ``RoundAlgorithm`` needs none."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""
    needs: ClassVar[Needs] = Needs()
    settings: ClassVar[type[Settings] | None] = None

    @classmethod
    def conflict(cls, run: Settings) -> str | None:
        """Why the rest of a run's training settings ``run`` (a ``TrainingSettings``: the experiment's
        configuration or a network task's) cannot go with this algorithm, beyond what its ``needs``
        say (those the configuration checks for every algorithm), in one line naming the settings
        to change; or None. The configuration and the network's task checks call it."""
        return None

    @classmethod
    def uses_graph(cls) -> bool:
        """Whether its nodes exchange with their topology's neighbours, so that a run's graph is
        what it used (not a server, a leader, everyone, or no one): what topology.png draws."""
        return cls.needs.endpoint in ("transport", "pull") and getattr(cls, "talks_to", "neighbours") == "neighbours"


class RoundAlgorithm(Definition):
    """A synchronous algorithm given as rules over stacks (see the module), run by both engines.

    Built with the run's ``rounds`` (who sends to whom each iteration, static or dynamic), the node
    count, the seed, its ``settings`` (an instance of its ``settings`` class, or None), every node's
    training samples (``shard_sizes``, the seeded partition's) and the ranks of the B rows it computes
    (``ranks``). The defaults are D-PSGD's: send the model, take the round's weighted average.

    An iteration may hold several exchanges (``phases``: FedAvg's clients push, then the server
    answers); ``exchange(iteration, phase)`` gives each as a value, and the engines pass it to that
    exchange's calls. Between calls a definition keeps only its ``begin`` state (and caches of what
    its settings and rounds fix), so no call depends on another having been made first.
    ``talks_to`` says whom a node of the process engine connects to: its topology's
    ``neighbours``, ``everyone``, or ``server`` (node 0 with everyone, the others with node 0)."""

    needs: ClassVar[Needs] = Needs(dynamic=True)
    linear: ClassVar[bool] = True  # merge_stack is merge(weighted sum): a sparse product in the batched engine
    overlaps: bool = False  # each exchange runs on during the next iteration's local steps (``settle``)
    keeps_missing: ClassVar[bool] = True  # a sender not heard in time leaves its weight to the node's own payload
    phases: ClassVar[int] = 1
    talks_to: ClassVar[str] = "neighbours"
    honest_tail: ClassVar[int] = 0  # a payload's last values a bad node sends as they are (its receivers check them)
    missing_chunks: str = "per-chunk"  # over a lossy transport (``needs.lossy``): the rule of ``MISSING_CHUNK_RULES``

    def __init__(self, rounds: Rounds, nodes: int, seed: int, settings: Settings | None = None,
                 shard_sizes: Sequence[int] = (), ranks: Sequence[int] = ()):
        self.rounds, self.nodes, self.seed, self.options = rounds, nodes, seed, settings
        self.shard_sizes, self.ranks = tuple(shard_sizes), list(ranks)
        self._own: tuple[Round | None, tuple[float, ...]] = (None, ())  # a cache: the last round's own weights

    def exchange(self, iteration: int, phase: int = 0) -> Exchange:
        """The exchange ``phase`` of ``iteration``: by default ``round``'s, each row's own weight by
        ``own_weights`` (worked out once per round) and the class's ``keeps_missing``. Override it
        for an iteration of several exchanges (FedAvg)."""
        exchange = self.round(iteration)
        if self._own[0] is not exchange:
            self._own = (exchange, tuple(self.own_weights(exchange, self.ranks)))
        return Exchange(iteration, phase, exchange, self._own[1], self.keeps_missing)

    def merge_refusal(self, robust_rule: str, lossy: bool) -> str | None:
        """Why the run's robust rule (``robust_rule``, "" for none) or its ``lossy`` transport cannot
        replace this definition's merge (one line), or None: both need the weighted sum (``linear``),
        which they take per chunk or by the rule; the engines' round runners ask it when built."""
        if self.linear or not (robust_rule or lossy):
            return None
        fix = f"use aggregation mean (not {robust_rule})" if robust_rule else "use transport tcp"
        what = "a robust rule could replace" if robust_rule else "that could be taken per chunk of what arrived"
        return f"algorithm {self.name} with these settings merges by its own rule, not a weighted sum {what}: {fix}"

    def round(self, iteration: int) -> Round:
        """Whom each node sends to and hears from in ``iteration``, and the weight of each sender."""
        return self.rounds.round(iteration)

    def trains(self, iteration: int) -> Sequence[int] | None:
        """The nodes whose local steps ``iteration`` asks for (None: every node). The others skip
        them (their models would not be used): no batch drawn, no step, no modelled compute."""
        return None

    def own_weights(self, exchange: Round, ranks: list[int]) -> list[float]:
        """The weight of each node's own payload in its merge (rows ``ranks``): by default what its
        senders' weights leave of one. With ``keeps_missing`` (the default, D-PSGD's rule) the
        engines add the weight of each sender whose payload did not come in time, so a node's
        weights always sum to one; without it (push-sum, whose weight accounts for it) that share
        is lost."""
        return [1.0 - sum(exchange.weights[rank].values()) for rank in ranks]

    def begin(self, own: Tensor) -> State:
        """The algorithm's per-node tensors, made once from the nodes' first models ``own`` [B, P]."""
        return {}

    def local_optimizer(self, optimizer: Any, state: State) -> Any:
        """What the engines' local steps call for this definition's rows: ``step(grads)`` with their
        gradients [B, P], ``set_lr(lr)`` with the schedule's rate. By default the run's ``optimizer``
        (``optim.make_optimizer``'s, over the rows' parameters: the first P values of ``own``)
        itself. A definition that steps its rows itself (gradient tracking into an adaptive step)
        keeps ``optimizer`` and returns a stand-in (``optim.GradientInbox``); one that averages the
        optimizer's state keeps it and reads its ``rows_state``. The engines call it once, after
        ``begin``; what it adds to ``state`` a checkpoint keeps."""
        return optimizer

    def start_round(self, own: Tensor, state: State, iteration: int) -> None:
        """Called with the models ``own`` each node starts ``iteration``'s local steps from (after
        any outer step of the iteration before)."""

    def settle(self, own: Tensor, state: State, iteration: int) -> None:
        """For an algorithm that ``overlaps``: called at ``iteration``, after its local steps, once the
        exchange of the iteration before is over and this iteration's push is made (its payload
        copied aside), to have the models take that exchange's outcome. The engines then start this
        iteration's exchange, which must read and write only the algorithm's state, never ``own``
        (the process engine runs it beside the next local steps); none starts at the last iteration."""

    def push(self, own: Tensor, state: State, exchange: Exchange, last: bool) -> Tensor | None:
        """For an algorithm that ``overlaps``, after an iteration's local steps, once the exchange
        of the iteration before is over: the payload of the iteration's first ``exchange`` (None at
        the ``last`` iteration, which starts no exchange), then ``settle``. Both engines call it,
        then start that exchange with that payload."""
        sent = None if last else self.payload(own, state, exchange)
        self.settle(own, state, exchange.iteration)
        return sent

    def span(self, iteration: int) -> tuple[int, int] | None:
        """The part [a, b) of the state ``iteration``'s exchange aggregates (an outer optimizer steps
        only it); None: all of it."""
        return None

    def payload_problem(self, payload: Tensor, exchange: Exchange) -> str | None:
        """Why a payload received from another process must not be merged, beyond its size, type and
        finite values, which the engine checks (a quantized one that does not decode), or None."""
        return None

    def payload(self, own: Tensor, state: State, exchange: Exchange) -> Tensor:
        """What each node sends in ``exchange``, [B, Q] (every peer gets the same). An engine may write
        into a payload that is neither ``own`` nor a tensor of ``state`` once it is sent; the
        definition must not change one it returned (a tensor of its own, not a buffer it fills
        again next exchange): the process engine's transport may still be sending it."""
        return own

    def merge(self, own: Tensor, state: State, mixed: Tensor, exchange: Exchange) -> None:
        """In place: each node's model and state from ``mixed`` [B, Q], the weighted sum of its own
        payload and those it received (for a ``linear`` algorithm)."""
        own.copy_(mixed)

    def merge_stack(self, own: Tensor, state: State, sent: Tensor, received: Tensor, weights: Tensor,
                    own_weight: Tensor, exchange: Exchange) -> None:
        """In place: each node's model and state from its own payload ``sent`` [B, Q] and those it
        ``received`` [B, K, Q] with their ``weights`` [B, K] (0 where none came) and ``own_weight``
        [B]. Override it (and set ``linear`` False) for a rule other than the weighted sum."""
        weights = weights.to(sent.dtype)
        mixed = sent * own_weight.to(sent.dtype)[:, None] + (received * weights[..., None]).sum(1)
        self.merge(own, state, mixed, exchange)


def one_step_refusal(name: str, run: Settings) -> str | None:
    """Why a run's settings ``run`` cannot go with algorithm ``name``, whose update rule takes one
    gradient per exchange (one local step an iteration), in one line; or None."""
    if getattr(run, "rounds", 1) != 1 or getattr(run, "full_epochs", False):
        return (f"algorithm {name} takes one local step per iteration, as its update rule is written: set rounds 1 "
                "(and not full_epochs)")
    return None


def row_stochastic_refusal(name: str, run: Settings) -> str | None:
    """Why a run's settings ``run`` cannot go with algorithm ``name``, whose tracker follows the
    average only under doubly stochastic weights: epidemic peer sampling's are row-stochastic only
    (a node averages what it hears, whoever sent it), in one line; or None."""
    if str(getattr(run, "peer_sampling", "off")).startswith("epidemic"):
        return (f"algorithm {name} needs doubly stochastic weights, which peer_sampling {run.peer_sampling} does not "
                "give (a node weighs whatever it hears alike): use peer_sampling graph, or algorithm pushsum")
    return None


DEFINITIONS: Registry[type[Definition]] = Registry("algorithm", built_in={
    name: f"meshlearn.definitions.{module}" for name, module in (
        ("dpsgd", "dpsgd"), ("gossip", "gossip"), ("leader", "leader"), ("fedavg", "fedavg"), ("local", "local"),
        ("pushsum", "pushsum"), ("tracking", "tracking"), ("gtadam", "gtadam"), ("dadam", "dadam"),
        ("qgdsgdm", "qgdsgdm"))})


def register_algorithm(cls: type[Definition]) -> type[Definition]:
    """Class decorator adding an algorithm to the one registry every engine, the configuration, the
    command line and network tasks choose from, under ``cls.name``."""
    return DEFINITIONS.add(cls.name, cls)


def definition(name: str) -> type[Definition]:
    """The algorithm registered under ``name`` (ConfigError listing the known ones if none is)."""
    return DEFINITIONS.get(name)


def names_that(accept) -> list[str]:
    """The registered algorithms whose declaration ``accept(needs)`` takes, sorted (loads every
    built-in declaration: no torch)."""
    return [name for name in DEFINITIONS.names() if accept(definition(name).needs)]


def algorithms_help() -> str:
    """Every registered algorithm with its summary, for the command line and the settings reference."""
    return " | ".join(f"{name} ({definition(name).summary})" for name in DEFINITIONS.names()) + \
        " | one registered by --models-module"


def round_algorithm(name: str, engine: str) -> type[RoundAlgorithm]:
    """The definition registered under ``name``, for an engine (``engine``: its name) that has no
    runtime of its own for it and runs it on its round runner; ConfigError if the algorithm is
    unknown or not a ``RoundAlgorithm``."""
    found = definition(name)
    if not issubclass(found, RoundAlgorithm):
        raise ConfigError(f"algorithm {name} has no runtime in the {engine} engine: give it one, or write it as a "
                          "RoundAlgorithm")
    return found
