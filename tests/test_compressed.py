"""Low-communication FedAvg: quantized pseudo-gradients with error feedback, and the model
synchronised in fragments on staggered schedules (Streaming DiLoCo)."""

import pytest
import torch
from helpers.engines import BASE

from meshlearn.config import make_config
from meshlearn.definitions.compressed import DeltaCodec
from meshlearn.definitions.fedavg import FedAvg, fragment_spans
from meshlearn.definitions.settings import FedAvgSettings
from meshlearn.errors import ConfigError
from meshlearn.outer import OuterOptimizer
from meshlearn.sharing.quantize import BUCKET


@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_keeps_what_rounding_left_out_for_the_next_change(bits):
    torch.manual_seed(0)
    numel = 1500
    codec = DeltaCodec(numel, torch.float32, seed=5, bits=bits)
    buckets = -(-numel // BUCKET)
    assert codec.nbytes == buckets * (8 + BUCKET * bits // 8)  # a float32 low end and step a bucket, then the codes
    change = torch.randn(numel) * 1e-3
    error, sent = torch.zeros(numel), torch.zeros(numel)
    out = torch.empty(codec.nbytes, dtype=torch.uint8)
    for round_ in range(50):  # the same change every round
        before = error.clone()
        codec.encode_(change.clone(), error, sender=1, iteration=round_, out=out)
        decoded = codec.decode(out)
        assert torch.allclose(error, change + before - decoded, atol=1e-9)  # exactly what the encoding left out
        step = float((change + before).abs().max()) * 2 / (2 ** bits - 1)
        assert float(error.abs().max()) <= step * 1.0001  # never more than one level
        sent += decoded
    # everything sent adds up to everything learned, but the last error: nothing is lost for good
    assert torch.allclose(sent + error, 50 * change, atol=1e-6)
    assert float((sent / 50 - change).abs().max()) < float(change.abs().max()) / 20


def test_a_received_change_that_does_not_decode_is_refused_with_the_reason():
    codec = DeltaCodec(600, torch.float32, seed=5, bits=8)
    good = torch.empty(codec.nbytes, dtype=torch.uint8)
    codec.encode_(torch.ones(600), torch.zeros(600), 0, 0, good)
    assert codec.problem(good) is None
    assert "expected" in codec.problem(good[:-1])  # a size that is not this model's
    nan = good.clone()
    nan[:4] = torch.tensor([float("nan")]).view(torch.uint8)  # the first bucket's low end
    assert "NaN or Inf" in codec.problem(nan)
    negative = good.clone()
    negative[4:8] = torch.tensor([-1.0]).view(torch.uint8)  # its step
    assert "negative" in codec.problem(negative)
    rules = FedAvg(None, 2, seed=5, settings=FedAvgSettings(compress="int8"), shard_sizes=[1, 1], ranks=[1])
    rules.begin(torch.ones(1, 600))  # what the process engine asks of each payload it received
    push = rules.exchange(0, 0)
    assert rules.payload_problem(good, push) is None and "NaN or Inf" in rules.payload_problem(nan, push)


def _exchange(rules: FedAvg, own: torch.Tensor, state: dict, iteration: int) -> list[torch.Tensor]:
    """One iteration of compressed FedAvg over every node's rows (B = N), everything arriving;
    returns the payloads of both exchanges."""
    rules.start_round(own, state, iteration)
    sent = []
    for phase in (0, 1):
        exchange = rules.exchange(iteration, phase)
        payload = rules.payload(own, state, exchange)
        senders = [list(exchange.round.receive_from[rank]) for rank in range(rules.nodes)]
        width = max(map(len, senders))
        received = torch.zeros((rules.nodes, width, payload.shape[1]), dtype=payload.dtype)
        weights = torch.zeros((rules.nodes, width), dtype=torch.float64)
        for rank, froms in enumerate(senders):
            for k, sender in enumerate(froms):
                received[rank, k], weights[rank, k] = payload[sender], exchange.round.weights[rank][sender]
        own_weight = torch.tensor(exchange.own_weights, dtype=torch.float64)
        rules.merge_stack(own, state, payload, received, weights, own_weight, exchange)
        sent.append(payload)
    return sent


def test_compressed_fedavg_sends_quantized_changes_and_every_node_takes_the_same_model():
    torch.manual_seed(1)
    sizes = [100, 200, 300, 400]
    rules = FedAvg(None, 4, seed=2, settings=FedAvgSettings(compress="int8"), shard_sizes=sizes, ranks=range(4))
    start = torch.randn(1, 2000).repeat(4, 1)
    own = start.clone()
    state = rules.begin(own)
    changes = torch.randn(4, 2000) * 0.01
    own -= changes  # each node's local steps
    push, answer = _exchange(rules, own, state, 0)
    assert push.dtype == answer.dtype == torch.uint8 and push.shape[1] == DeltaCodec(2000, torch.float32, 2, 8).nbytes
    assert torch.equal(push[0], torch.zeros_like(push[0]))  # the server's own change does not travel
    assert all(torch.equal(own[0], row) for row in own)  # everyone holds one model
    expected = start[0] - (torch.tensor(sizes, dtype=torch.float32)[:, None] * changes).sum(0) / sum(sizes)
    level = 0.02 * 4 / 255  # about the widest change's range over 255 levels, rounded twice
    assert float((own[0] - expected).abs().max()) < level
    assert float(state["error"][1:].abs().max()) > 0 and float(state["error"][0].abs().max()) > 0  # both ways
    # the next round's changes start from the model each node starts its steps from (after an outer step)
    taken = own.clone()
    own += 0.5
    rules.start_round(own, state, 1)
    assert torch.equal(state["before"], own) and not torch.equal(state["before"], taken)


def test_fragments_split_the_state_and_each_is_exchanged_every_f_iterations():
    assert fragment_spans(10, 3) == [(0, 3), (3, 6), (6, 10)] and fragment_spans(2, 5) == [(0, 1), (1, 2)]
    assert fragment_spans(7, 1) == [(0, 7)]
    rules = FedAvg(None, 3, seed=0, settings=FedAvgSettings(fragments=3), shard_sizes=[1, 1, 1], ranks=range(3))
    own = torch.zeros(3, 10)
    rules.begin(own)
    assert [rules.span(i) for i in range(7)] == [(0, 3), (3, 6), (6, 10), (0, 3), (3, 6), (6, 10), (0, 3)]
    assert rules.payload(own, {}, rules.exchange(4, 0)).shape == (3, 3 + 1)  # part 1's values, then the 1 the weights add up in
    with pytest.raises(ConfigError, match="fedavg_fragments needs fedavg_fraction 1"):
        make_config({"algorithm": "fedavg", "fedavg_fragments": 2, "fedavg_fraction": 0.5})


def test_an_outer_step_on_a_span_moves_only_that_part():
    outer = OuterOptimizer.model_validate("nesterov:lr=0.7,momentum=0.9")
    start = torch.zeros(2, 6)
    state = outer.begin(start)
    aggregate = torch.full((2, 6), -1.0)
    outer.step(aggregate, state, (2, 4))
    assert torch.allclose(aggregate[:, 2:4], torch.full((2, 2), -0.7 * 1.9))  # lr * (g + mu * (mu * 0 + g))
    assert torch.equal(aggregate[:, [0, 1, 4, 5]], torch.full((2, 4), -1.0))  # the others: as they came
    assert torch.equal(state["before"][:, [0, 1, 4, 5]], torch.zeros(2, 4)) and \
        torch.equal(state["before"][:, 2:4], aggregate[:, 2:4])
    assert float(state["momentum"][:, [0, 1, 4, 5]].abs().sum()) == 0
    outer.step(aggregate, state, (6, 9))  # past the parameters (the model's buffers): no outer step
    assert torch.equal(aggregate[:, 4:], torch.full((2, 2), -1.0))


def test_streamed_runs_synchronise_the_part_of_each_iteration_and_count_a_parts_bytes(tmp_path):
    values = {**BASE, "algorithm": "fedavg", "iterations": 4, "rounds": 2}
    from meshlearn.batched import BatchedSimulation
    from meshlearn.topology import build_topology

    def run(extra: dict, name: str):
        config = make_config({**values, **extra, "engine": "batched", "step_time": 0.001})
        simulation = BatchedSimulation(config, build_topology(config.topology, config.nodes, config.seed),
                                       tmp_path / name)
        summaries = simulation.run()
        return simulation.stacked.state, sum(s["stats"]["bytes_sent"] for s in summaries.values())

    whole, whole_bytes = run({}, "whole")
    parts, parts_bytes = run({"fedavg_fragments": 3, "outer": "nesterov:lr=0.7,momentum=0.9"}, "parts")
    (a, b), = fragment_spans(parts.shape[1], 3)[0:1]  # iteration 3, the last, exchanged part 0
    assert all(torch.equal(row[a:b], parts[0, a:b]) for row in parts)
    assert not torch.equal(parts[1, b:], parts[2, b:])  # parts 1 and 2: each node's steps since its exchange
    assert parts_bytes < whole_bytes / 2.5  # about a third of the model an iteration
    int4, int4_bytes = run({"fedavg_compress": "int4"}, "int4")
    assert all(torch.equal(row, int4[0]) for row in int4)
    assert whole_bytes / int4_bytes > 7  # 4 bits and a scale per 512 values, against 32 bits
    assert float((int4 - whole).abs().max()) < 0.05 * float(whole.abs().max())


def test_an_overlapped_exchange_reads_and_writes_apart_from_the_models_and_is_taken_one_iteration_late():
    torch.manual_seed(2)
    rules = FedAvg(None, 3, seed=2, settings=FedAvgSettings(overlap=True, mix=0.25), shard_sizes=[1, 1, 2],
                   ranks=range(3))
    own = torch.randn(3, 8)
    state = rules.begin(own)
    assert rules.span(0) == (0, 0) and rules.span(1) == rules.span(5) == (0, 8)  # an outer step only on what was taken
    trained = own.clone()
    push = rules.push(own, state, rules.exchange(0, 0), last=False)  # what both engines do: the push, ``settle``, then the exchange
    assert torch.equal(own, trained)  # nothing to take yet
    own.add_(1.0)  # the next local steps, while the exchange goes on
    during = own.clone()
    _exchange_from(rules, own, state, 0, push)
    assert torch.equal(own, during)  # the exchange never touched the models that train on
    average = (trained * torch.tensor([[1.0], [1.0], [2.0]])).sum(0) / 4
    assert all(torch.allclose(row, average) for row in state["late"])
    assert rules.push(own, state, rules.exchange(1, 0), last=True) is None  # the last iteration: no push, the outcome of iteration 0
    assert all(torch.allclose(row, average) for row in own) and torch.equal(state["local"], during)
    own.mul_(2.0)  # an outer step on it
    rules.start_round(own, state, 2)  # before iteration 2's steps: mixed with the part as trained meanwhile
    assert torch.allclose(own, 0.75 * 2.0 * average + 0.25 * during)


def _exchange_from(rules: FedAvg, own: torch.Tensor, state: dict, iteration: int, push: torch.Tensor) -> None:
    """The phases of one uncompressed FedAvg exchange (linear: the engines' weighted sums), everything arriving,
    with ``push`` the payload already made."""
    for phase in (0, 1):
        exchange = rules.exchange(iteration, phase)
        payload = push if phase == 0 else rules.payload(own, state, exchange)
        own_weight = exchange.own_weights
        mixed = torch.stack([payload[rank] * own_weight[rank] + sum(
            (payload[sender] * weight for sender, weight in exchange.round.weights[rank].items()),
            torch.zeros_like(payload[rank])) for rank in range(3)])
        rules.merge(own, state, mixed, exchange)


def test_the_process_engine_trains_on_while_an_overlapped_exchange_is_under_way(tmp_path, monkeypatch):
    import threading

    from helpers.engines import process_engine_states

    from meshlearn.node.algorithms.rounds import RoundRunner
    from meshlearn.node.node import Node

    stepped_during: list[bool] = []
    step_taken = threading.Event()
    phases, train_step = RoundRunner._phases, Node.train_step

    def slow_phases(self, iteration, *made):
        if threading.current_thread().name.startswith("exchange-") and self.ctx.rank == 1:  # the exchange thread
            step_taken.clear()
            stepped_during.append(step_taken.wait(timeout=30))  # a local step of the next iteration comes meanwhile
        return phases(self, iteration, *made)

    def noting_step(self):
        if self.rank == 1:
            step_taken.set()
        return train_step(self)

    monkeypatch.setattr(RoundRunner, "_phases", slow_phases)
    monkeypatch.setattr(Node, "train_step", noting_step)
    states = process_engine_states({**BASE, "algorithm": "fedavg", "fedavg_overlap": True, "iterations": 4})
    assert stepped_during == [True, True, True]  # iterations 0-2 overlap the next steps; the last starts none
    assert all(torch.equal(state, states[0]) for state in states)  # the last iteration took iteration 2's outcome
