"""The batched engine's worker threads: the count changes the speed of a run, never its results."""

import threading

import pytest
import torch
from helpers.engines import BASE
from helpers.waiting import wait_until

from meshlearn.batched import BatchedSimulation
from meshlearn.batched.workers import WorkerChoice, Workers
from meshlearn.config import make_config
from meshlearn.topology import build_topology


def _run(values: dict, output, workers: int) -> BatchedSimulation:
    config = make_config({**BASE, **values, "engine": "batched", "step_time": 0.001, "batched_workers": workers})
    simulation = BatchedSimulation(config, build_topology(config.topology, config.nodes, config.seed), output)
    simulation.run()
    return simulation


@pytest.mark.parametrize("values", [
    {"model": "lenet", "batched_vectorize": "off"},  # a convolution's result depends on its intra-op threads
    {"model": "mlp", "batched_vectorize": "on", "nodes": 7, "topology": "ring"},  # vmap: 7 nodes, or 3, 3 and 1
    {"model": "mlp", "batched_vectorize": "on", "algorithm": "fedavg", "fedavg_fraction": 0.5}])
def test_one_worker_and_three_give_the_same_models_bit_for_bit(tmp_path, values):
    one = _run(values, tmp_path / "one", 1)
    three = _run(values, tmp_path / "three", 3)
    assert torch.equal(one.stacked.state, three.stacked.state)
    start = _run({**values, "rounds": 0}, tmp_path / "start", 1).stacked.state
    assert not torch.equal(one.stacked.state, start)  # the nodes did train


@pytest.mark.parametrize("values", [
    {"model": "mlp", "batched_vectorize": "on", "nodes": 7, "topology": "ring"},  # blocks of consecutive rows
    {"model": "mlp", "batched_vectorize": "on", "algorithm": "fedavg", "fedavg_fraction": 0.5}])  # drawn rows
def test_plain_sgd_in_the_workers_gives_the_models_of_the_step_after_them_bit_for_bit(tmp_path, monkeypatch, values):
    from meshlearn.batched import models

    fused = []
    fuse = models.NodeModels.fuse
    monkeypatch.setattr(models.NodeModels, "fuse", lambda self, optimizer: fused.append(fuse(self, optimizer)))
    inside = _run(values, tmp_path / "inside", 2)
    monkeypatch.setattr(models.NodeModels, "fuse", lambda self, optimizer: fused.append(False))
    after = _run(values, tmp_path / "after", 2)
    assert fused == [True, False]
    assert torch.equal(inside.stacked.state, after.stacked.state)


def test_a_model_that_draws_random_numbers_trains_on_one_worker_in_rank_order(tmp_path):
    # SimpleCNN's dropout draws from torch's one generator: from several threads at once, the draws
    # would go to nodes in an order that changes from run to run
    values = {"model": "simplecnn", "nodes": 4, "iterations": 2, "rounds": 1}
    runs = [_run(values, tmp_path / str(k), 3) for k in range(2)]
    assert all(run_.stacked is not None for run_ in runs)
    assert torch.equal(runs[0].stacked.state, runs[1].stacked.state)
    one = _run(values, tmp_path / "one", 1)
    assert torch.equal(one.stacked.state, runs[0].stacked.state)


def test_a_plain_model_is_found_to_draw_nothing(tmp_path, monkeypatch):
    from meshlearn.batched import models

    seen = []
    close = models.NodeModels.close
    monkeypatch.setattr(models.NodeModels, "close", lambda self: seen.append(self.draws_random) or close(self))
    _run({"model": "lenet", "nodes": 4, "iterations": 1, "rounds": 1}, tmp_path / "lenet", 2)
    _run({"model": "simplecnn", "nodes": 4, "iterations": 1, "rounds": 1}, tmp_path / "cnn", 2)
    assert seen == [False, True]


def test_the_choice_times_each_candidate_then_keeps_the_fastest():
    choice = WorkerChoice([1, 2], trials=3)
    seconds = {1: [0.9, 1.0, 5.0], 2: [0.6, 0.7, 0.5]}  # one outlier on one worker: the median ignores it
    while choice.chosen is None:
        count = choice.next()
        choice.record(count, seconds[count].pop(0))
    assert choice.chosen == 2 and choice.next() == 2
    assert seconds == {1: [], 2: []}  # three steps of each, alternating, and no more
    choice.record(1, 0.0)  # later steps change nothing
    assert choice.next() == 2


def test_a_tie_keeps_fewer_workers_and_a_fixed_count_needs_no_trial():
    choice = WorkerChoice([4, 1], trials=1)
    choice.record(choice.next(), 1.0)
    choice.record(choice.next(), 1.0)
    assert choice.chosen == 1
    assert WorkerChoice([3]).chosen == 3
    with pytest.raises(ValueError):
        WorkerChoice([])


def test_workers_split_jobs_in_order_use_their_own_state_and_one_intra_op_thread():
    made = []
    workers = Workers(3, lambda: made.append(object()) or made[-1])
    done: list[tuple[object, list[int], int, str]] = []
    lock = threading.Lock()

    def work(own, part):
        with lock:
            done.append((own, list(part), torch.get_num_threads(), threading.current_thread().name))
    try:
        workers.run(work, list(range(7)), 3)
        assert sorted(part for _, part, _, _ in done) == [[0, 1], [2, 3], [4, 5, 6]]
        assert len({id(own) for own, _, _, _ in done}) == 3 and len(made) == 3
        assert all(threads == 1 and name.startswith("meshlearn-worker") for _, _, threads, name in done)
        done.clear()
        workers.run(work, [0, 1], 5)  # never more workers than jobs, nor than the pool has
        assert sorted(part for _, part, _, _ in done) == [[0], [1]] and len(made) == 3
    finally:
        workers.close()


def test_a_failing_job_is_raised_after_every_worker_is_done():
    workers = Workers(2, object)
    finished = []

    def work(_own, part):
        part = list(part)
        if part == [0]:
            raise RuntimeError("job 0 broke")
        finished.append(part)
    try:
        with pytest.raises(RuntimeError, match="job 0 broke"):
            workers.run(work, [0, 1], 2)
        assert finished == [[1]]
    finally:
        workers.close()


def test_closing_stops_a_part_after_its_current_job():
    """Ctrl-C in the middle of a step: the step is left (its caller interrupted) and the workers
    closed; each stops after the job in hand instead of doing the rest of its part (a language
    model's step took seconds more)."""
    workers = Workers(1, object)
    in_job, release = threading.Event(), threading.Event()
    done: list[int] = []

    def work(_own, part):
        for job in part:
            in_job.set()
            assert release.wait(30)
            done.append(job)

    step = threading.Thread(target=workers.run, args=(work, [0, 1, 2], 1), daemon=True)
    step.start()
    assert in_job.wait(30)  # the worker is in job 0
    stopping = workers._stopping
    closing = threading.Thread(target=workers.close, daemon=True)
    closing.start()
    assert wait_until(stopping.is_set, 10)  # closing, and waiting for the worker
    release.set()
    closing.join(30)
    step.join(30)
    assert not closing.is_alive() and not step.is_alive()
    assert done == [0]
    workers.run(work, [3, 4], 1)  # closed workers start again, and a new run's parts are not stopped
    assert done == [0, 3, 4]
    workers.close()
