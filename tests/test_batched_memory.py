"""The batched engine's memory: vectorized calls sized by the model's activations, one heap for its
threads, and the README's language-model run well within a laptop's memory."""

import subprocess
import sys

import pytest
import torch
from helpers.engines import BASE

from meshlearn.batched import BatchedSimulation
from meshlearn.batched import setup as batched_engine
from meshlearn.batched.models import NodeModels
from meshlearn.config import make_config
from meshlearn.models import build_model
from meshlearn.models.cost import saved_activation_bytes
from meshlearn.topology import build_topology

GB = 2 ** 30
TOKENS = torch.zeros(64, dtype=torch.int64)  # one window of the README's language-model run (--context 64)


def test_the_activations_a_forward_pass_keeps_are_counted_by_hand():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    rng = torch.get_rng_state()
    # the linear layer keeps its input (1 x 4 floats; its weight is the model's, not counted), ReLU its output (1 x 3)
    assert saved_activation_bytes(model, torch.zeros(1, 4)) == 4 * (4 + 3)
    assert saved_activation_bytes(model, torch.zeros(5, 4)) == 5 * 4 * (4 + 3)
    assert model.training and torch.equal(rng, torch.get_rng_state())


def test_a_vectorized_call_on_the_cpu_takes_as_many_nodes_as_its_activations_allow():
    gpt = build_model("gpt-tiny", (64,), 256)
    readme = make_config({"engine": "batched", "model": "gpt-tiny", "context": 64})  # batch 32: 75 MB a node
    assert batched_engine.training_chunk(readme, gpt, TOKENS) == 1
    assert batched_engine.training_chunk(readme.model_copy(update={"batch_size": 4}), gpt, TOKENS) == 13
    mlp = build_model("mlp", (1, 8, 8), 10)  # digits: 1,024 nodes still in one call
    assert batched_engine.training_chunk(make_config({"engine": "batched"}), mlp, torch.zeros(1, 8, 8)) >= 1024
    chosen = make_config({"engine": "batched", "model": "gpt-tiny", "batched_chunk": 5})
    assert batched_engine.training_chunk(chosen, gpt, TOKENS) == 5  # as asked
    gpu = make_config({"engine": "batched", "model": "gpt-tiny", "device": "cuda"})
    assert batched_engine.training_chunk(gpu, gpt, TOKENS) == 0  # all at once: a GPU is vectorized for speed


def _lm_run(output, chunk: int, calls: list[int]) -> torch.Tensor:
    values = {**BASE, "engine": "batched", "dataset": "pystdlib", "model": "gpt-tiny", "context": 16, "batch_size": 4,
              "nodes": 4, "topology": "ring", "iterations": 2, "rounds": 1, "optimizer": "adam", "lr": 0.003, "test_after": 2,
              "eval_samples": 8, "step_time": 0.001, "batched_workers": 1, "batched_chunk": chunk}
    config = make_config(values)
    simulation = BatchedSimulation(config, build_topology(config.topology, config.nodes, config.seed), output)
    simulation.run()
    assert calls, "no vectorized call was made"
    return simulation.stacked.state


def test_language_model_nodes_train_and_are_evaluated_in_bounded_blocks_to_the_same_models(tmp_path, monkeypatch):
    training, evaluation = [], []
    vectorized, init = NodeModels._vectorized, NodeModels.__init__

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        forward = self._vforward
        self._vforward = lambda named, x: evaluation.append(len(x)) or forward(named, x)

    monkeypatch.setattr(NodeModels, "_vectorized", lambda self, replica, ranks, *rest: training.append(len(ranks))
                        or vectorized(self, replica, ranks, *rest))
    monkeypatch.setattr(NodeModels, "__init__", recording_init)
    whole = _lm_run(tmp_path / "whole", 4, training)
    # batched_chunk 4: every node in each call (and the nodes' average model, evaluated as one more node)
    assert set(training) == {4} and set(evaluation) == {4, 1}
    training.clear()
    evaluation.clear()
    per_node = 4 * saved_activation_bytes(build_model("gpt-tiny", (16,), 256), torch.zeros(1, 16, dtype=torch.int64))
    monkeypatch.setattr(batched_engine, "ACTIVATIONS_PER_CALL", 2 * per_node + 1)  # room for two nodes a call
    blocks = _lm_run(tmp_path / "blocks", 0, training)
    assert set(training) == {2} and set(evaluation) == {2, 1}
    assert torch.equal(whole, blocks)  # the block size never changes a node's result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
@pytest.mark.parametrize("keep", [False, True])
def test_a_worker_thread_reuses_what_another_thread_freed_once_freed_memory_is_kept(keep):
    # glibc's own malloc, as torch's CPU tensors use it: a 16 MiB block written and freed by this
    # thread, then one of the same size written by a thread started afterwards (a worker)
    program = f"""
import ctypes, resource, threading
from meshlearn.batched.memory import keep_freed_memory
assert keep_freed_memory() if {keep} else True
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def touch():
    block = libc.malloc(16 << 20)
    libc.memset(block, 1, 16 << 20)
    libc.free(block)
def worker():
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    touch()
    print(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
touch()
thread = threading.Thread(target=worker)
thread.start()
thread.join()
"""
    faulted = int(subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True,
                                 timeout=120).stdout)
    pages = 16 * 1024 * 1024 // 4096
    assert (faulted < pages // 10) if keep else (faulted > pages // 2)


@pytest.mark.slow  # 15-35 s on 2 cores; quick siblings: the block sizes above, and the shared heap
def test_the_readmes_language_model_run_stays_well_within_two_gigabytes(tmp_path):
    # The README's command (8 gpt-tiny nodes, 32 windows of 64 tokens each a step) for its first two
    # iterations, which hold its peak: every node's first step, the choice of worker count, an
    # evaluation. Before vectorized calls were sized and the workers shared one heap: 3.5 GB.
    flags = ["simulate", "--engine", "batched", "--nodes", "8", "--dataset", "pystdlib", "--model", "gpt-tiny",
             "--context", "64", "--optimizer", "adamw", "--lr", "0.003", "--lr-schedule", "cosine:warmup=10",
             "--iterations", "2", "--test-after", "2", "--eval-samples", "256", "--quiet", "--output",
             str(tmp_path / "lm")]
    program = f"""
import resource, sys
from meshlearn.cli.main import main
code = main({flags!r})
print(code, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""
    done = subprocess.run([sys.executable, "-c", program], check=False, capture_output=True, text=True, timeout=600)
    code, peak_kb = done.stdout.split()[-2:]
    assert code == "0" and "test perplexity" in done.stdout, done.stdout + done.stderr
    assert int(peak_kb) * 1024 < 1.5 * GB  # measured 0.9 GB (the whole 80 iterations: 1.2 GB)
