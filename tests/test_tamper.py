"""Engine messages tampered with on the path (issue 32, items 5 and 6): a network task's providers,
built as ``network.taskrun`` builds them (``TaskSpec.experiment_config``, every engine endpoint
sealed with the task's key), train on digits while a proxy in front of one provider's engine
endpoint damages some of the messages to and from it, or plays old ones again. Every run must
end (a task stuck in a wait is the failure this guards against: the limit is generous, never a
speed test), with the clean run's accuracy (within 2 points) and the refused messages counted."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
from helpers.tamper import KINDS, TamperProxy

from meshlearn.models import build_model
from meshlearn.network.provider.taskdata import task_dataset
from meshlearn.network.task.spec import Peer, TaskSpec
from meshlearn.node import Node, make_transport
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology
from meshlearn.wire.sealed import FrameSeal

HOST = "127.0.0.1"
PROVIDERS = 4
TAMPERED = 0  # the provider whose engine endpoint the proxy stands in front of (the leader, in leader tasks)
LIMIT = 60.0  # seconds a node may take: about 7 times the slowest run here, far beyond any run that does not hang
TOLERANCE = 0.02  # accuracy a tampered run may differ by (clean leader and gossip runs differ by up to 0.005)
SETTINGS = {  # per algorithm: the task's settings (long enough to converge), and how the proxy tampers: with
    # models only (4096 bytes and more) where the first message is a handshake (D-PSGD) or where a refusal, itself
    # damaged, would blur the count of refusals (gossip); with pings too in leader tasks
    "leader": ({"epochs": 40, "aggregate_every": 4, "peer_timeout": 10.0}, {"every": 5, "limit": 6, "min_bytes": 0}),
    "dpsgd": ({"epochs": 20, "aggregate_every": 4, "peer_timeout": 3.0}, {"every": 5, "limit": 2}),
    "gossip": ({"epochs": 25, "aggregate_every": 4, "peer_timeout": 10.0}, {"every": 5, "limit": 6}),
}


@dataclass
class Outcome:
    """What one run of a task came to."""

    nodes: list[Node]
    accuracy: float  # the providers' final models on the test set, on average
    seconds: float
    malformed: int  # messages the providers refused, in all: they did not open ...
    replayed: int  # ... or they opened, but had been taken before
    tampered: int = 0  # what the proxies did
    injected: int = 0
    resent: int = 0  # models sent again at once because their receiver refused them (D-PSGD over TCP)


def _spec(algorithm: str, **overrides) -> TaskSpec:
    settings = {**SETTINGS[algorithm][0], **overrides}
    return TaskSpec(task_id="tampered", model="mlp", batch_size=16, lr=0.05, algorithm=algorithm, seed=11,
                    partition="iid", eval_samples=0, data={"mode": "local", "dataset": "digits"},
                    peers=[Peer(id=f"p{i}", address=f"{HOST}:{9000 + i}") for i in range(PROVIDERS)], **settings)


def _providers(spec: TaskSpec) -> list[Node]:
    """The task's providers, each with its engine as ``TaskRun._prepare`` builds it."""
    key, nodes = FrameSeal.new_key(), []
    for index, peer in enumerate(spec.peers):
        dataset, indices = task_dataset(spec, index, None, b"", peer.id, None)
        config = spec.experiment_config(len(indices), HOST, "cpu", 64.0)
        graph = build_topology("full", config.nodes, spec.seed)
        torch.manual_seed(spec.seed)  # every provider starts from the same model
        model = build_model(spec.model, dataset.input_shape, dataset.num_classes)
        seal = FrameSeal(key)
        nodes.append(Node(index, config, graph, dataset, indices, model,
                          lambda flat, config=config, index=index, seal=seal:
                          make_transport(config, index, flat, HOST, 0, seal=seal)))
    return nodes


def _run(algorithm: str, kind: str | None = None, behind: tuple[int, ...] = (TAMPERED,),
         tampering: dict | None = None, **settings) -> Outcome:
    """Run the task, with ``kind`` of tampering on the way to and from the providers ``behind``
    proxies (as ``tampering`` says, else as ``SETTINGS``), with the task's ``settings`` changed."""
    nodes = _providers(_spec(algorithm, **settings))
    proxies: list[TamperProxy] = []

    def through_a_proxy(book: dict[int, str]) -> None:
        for rank in behind:
            proxies.append(TamperProxy(book[rank], kind, seed=3 + rank, **(tampering or SETTINGS[algorithm][1])))
            book[rank] = proxies[-1].address  # every other provider reaches it through the proxy

    started = time.monotonic()
    try:
        run_threads(nodes, timeout=LIMIT, on_bound=through_a_proxy if kind else None)
    finally:
        for proxy in proxies:
            proxy.close()
    seconds = time.monotonic() - started
    accuracy = sum(node.evaluate().accuracy for node in nodes) / len(nodes)
    stats = [node.transport.stats for node in nodes]
    outcome = Outcome(nodes, accuracy, seconds, sum(s.malformed_dropped for s in stats),
                      sum(s.replay_dropped for s in stats), resent=sum(node.transport.extra_stats().get("resent", 0)
                                                                      for node in nodes))
    for proxy in proxies:
        outcome.tampered += proxy.tampered
        outcome.injected += proxy.injected
    return outcome


@pytest.fixture(scope="module")
def clean():
    """The clean run of each algorithm (run once, when first asked for)."""
    runs: dict[str, Outcome] = {}

    def get(algorithm: str) -> Outcome:
        if algorithm not in runs:
            runs[algorithm] = _run(algorithm)
            assert runs[algorithm].malformed == runs[algorithm].replayed == 0
        return runs[algorithm]

    return get


def _check(clean_run: Outcome, algorithm: str, kind: str) -> None:
    """Run ``kind`` of tampering and check what every kind must give, then what ``algorithm`` must."""
    run = _run(algorithm, kind)
    print(f"{algorithm} {kind}: accuracy {run.accuracy:.4f} (clean {clean_run.accuracy:.4f}), {run.seconds:.1f} s "
          f"(clean {clean_run.seconds:.1f} s), tampered {run.tampered}, injected {run.injected}, refused "
          f"{run.malformed} that did not open and {run.replayed} replayed")
    assert abs(run.accuracy - clean_run.accuracy) <= TOLERANCE
    if kind == "replay":
        assert run.injected > 0 and run.replayed == run.injected  # every copy played again was refused
    else:
        assert run.tampered > 0 and run.malformed == run.tampered  # every damaged message was refused, once
    ALGORITHM_CHECKS[algorithm](clean_run, run, kind)


def _leader_checks(clean_run: Outcome, run: Outcome, kind: str) -> None:
    """The leader stayed the leader (no one took it for dead), and its book took exactly one push
    per member and cycle, however often one was refused and sent again, or played again."""
    assert all(node.algorithm.election.leader == 0 and not node.algorithm.election.dead for node in run.nodes)
    iterations = run.nodes[0].config.iterations
    assert {m: c.updates for m, c in run.nodes[0].algorithm.state.contributions.items()} == \
        dict.fromkeys(range(PROVIDERS), iterations)


def _dpsgd_checks(clean_run: Outcome, run: Outcome, kind: str) -> None:
    """A damaged model whose seal header still names it is refused at once and sent again, so no
    one waits for a deadline; one too damaged to be named (its header changed) is waited for until
    the deadline, then the iteration goes on without it. Copies played again change nothing:
    D-PSGD is deterministic, so every model ends bit for bit as in the clean run."""
    if kind == "replay":
        assert all(torch.equal(node.flat.state, twin.flat.state) for node, twin in zip(run.nodes, clean_run.nodes))
    elif kind in ("flip", "truncate", "swap"):  # the chunks damaged, the header whole
        assert run.resent == run.tampered
        assert run.nodes[TAMPERED].transport.stats.gather_timeouts == 0
    else:
        assert run.resent + run.nodes[TAMPERED].transport.stats.gather_timeouts >= 1


def _gossip_checks(clean_run: Outcome, run: Outcome, kind: str) -> None:
    """Gossip merges whatever state a peer holds when it is asked, so two runs differ by timing and
    no equality can be asserted. What can: every damaged answer ended its fetch at once, as a
    refusal (rather than a wait for the fetch's timeout), and a copy played again was never taken
    for the answer awaited (nor for a refusal)."""
    refusals = sum(node.transport.fetch_refusals for node in run.nodes)
    assert refusals == (0 if kind == "replay" else run.tampered)


ALGORITHM_CHECKS = {"leader": _leader_checks, "dpsgd": _dpsgd_checks, "gossip": _gossip_checks}


# quick: three kinds on the leader, a replay on each of the others; every other pair runs with -m slow
QUICK = [("leader", kind) for kind in ("flip", "truncate", "replay")] + [("dpsgd", "replay")]  # gossip: slow (16 s)
SLOW = [(algorithm, kind) for algorithm in ("leader", "dpsgd", "gossip") for kind in KINDS if (algorithm, kind) not in QUICK]


@pytest.mark.parametrize("algorithm, kind", QUICK)
def test_a_task_tampered_with_on_the_path_ends_as_the_clean_one(clean, algorithm, kind):
    _check(clean(algorithm), algorithm, kind)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm, kind", SLOW)
def test_every_kind_of_tampering_in_every_algorithm(clean, algorithm, kind):
    _check(clean(algorithm), algorithm, kind)


FLIPPED = {"every": 2, "limit": 10**6}  # every second model on the way to each provider, as the audit did
PATIENT = 120.0  # seconds a D-PSGD node waits for a model: a damaged one waited for would stall the run


def test_a_dpsgd_task_with_every_second_model_damaged_sends_each_again_at_once(clean):
    """Every provider behind a proxy that flips a bit of every second model sent to it, and a wait
    for a model far longer than the run's limit: each damaged model is refused at once and sent
    again (never waited for), so the run ends, with every model bit for bit the clean run's."""
    run = _run("dpsgd", "flip", behind=tuple(range(PROVIDERS)), tampering=FLIPPED, peer_timeout=PATIENT)
    twin = clean("dpsgd")
    stats = [node.transport.stats for node in run.nodes]
    print(f"dpsgd, every second model flipped: {run.seconds:.1f} s (clean {twin.seconds:.1f} s), tampered "
          f"{run.tampered}, resent {run.resent}")
    assert run.tampered >= run.nodes[0].config.iterations  # about half of each provider's 3 models a round
    assert run.malformed == run.tampered and run.resent == run.tampered  # each refused, and sent again, once
    assert sum(s.gather_timeouts for s in stats) == 0
    assert sum(node.transport.extra_stats()["resends_declined"] for node in run.nodes) == 0
    assert all(torch.equal(node.flat.state, other.flat.state) for node, other in zip(run.nodes, twin.nodes))


def test_a_provider_shut_out_of_a_leader_task_is_neither_followed_nor_counted():
    """A revoked provider that does not stop (its code is not ours): the others exclude it mid-task
    (as a provider does when its heartbeat says the key was revoked); it was their leader, so they
    elect the next one, drop whatever it sends, and end with one model of their own."""
    nodes = _providers(_spec("leader"))
    shut_out = 0

    def exclude_at_the_fifth_iteration(node: Node, iteration: int, record: dict) -> None:
        if iteration == 4:
            node.algorithm.exclude(shut_out)

    for node in nodes[1:]:
        node.hooks.append(exclude_at_the_fifth_iteration)
    run_threads(nodes, timeout=LIMIT)
    honest = nodes[1:]
    assert {node.algorithm.election.leader for node in honest} == {1}
    assert all(node.algorithm.election.is_dead(shut_out) for node in honest)
    finals = [node.flat.state for node in honest]
    assert all(torch.equal(finals[0], other) for other in finals[1:])  # one model among them
    assert not torch.equal(finals[0], nodes[shut_out].flat.state)
    book = nodes[shut_out].algorithm.state  # it led itself on, but got no model from the others after the fifth
    assert all(book.contributions[j].updates <= 5 for j in range(1, PROVIDERS)), book.contributions
    assert sum(node.evaluate().accuracy for node in honest) / len(honest) > 0.9
