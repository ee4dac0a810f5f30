"""CloudMesh's experiment: a network run (bootstrap + providers + requester) against one process, side by side.

Both train the same model for the same epochs and batch size on the same data and are evaluated
on the same test set; the network run is timed from `meshlearn request` to the result on disk
(claim, data transfer, training, aggregation, evaluation, result copy), and by its training
time alone. Everything runs on this machine, each role in its own process over loopback.

    python benchmarks/cloudmesh.py [--data ../shared/datasets/cifar10-jpeg.tar.gz] [--model simplecnn]
        [--epochs 10] [--batch-size 16] [--lr 0.01] [--momentum 0] [--providers 4] [--device cpu|cuda]
        [--threads-per-provider 1] [--variants epoch:0.01 100:0.04 50:0.04:dpsgd] [--fedavg-fraction 1]

Each variant is one network run, AGGREGATE_EVERY:LR[:ALGORITHM] (batches or `epoch`, the
providers' learning rate, leader by default); all run after the single-process baseline, in one
invocation. ALGORITHM: leader (asynchronous), leader-sync (the synchronous leader, the CloudMesh
report's code: every cycle waits for every provider), fedavg (the synchronous leader weighing by
samples, taking --fedavg-fraction of the providers' models each cycle), dpsgd or gossip. By
default the four of them, side by side:

    python benchmarks/cloudmesh.py --data digits --model mlp --epochs 5 --lr 0.05 --providers 4 \
        --variants 10:0.05 10:0.05:leader-sync 10:0.05:fedavg 10:0.05:dpsgd
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from meshlearn.data import ShardLoader, load_dataset
from meshlearn.models import build_model
from meshlearn.network.task.spec import dataset_spec
from meshlearn.node import evaluate_model

ROOT = Path(__file__).resolve().parents[1]
SECRET = "benchmark-secret"
ALGORITHM_FLAGS = {"leader-sync": ["--algorithm", "leader", "--leader-sync", "true"]}  # else --algorithm NAME


def single_process(args) -> dict:
    """The baseline: one process, all the training data, plain mini-batch SGD."""
    torch.set_num_threads(args.baseline_threads)
    dataset = load_dataset(dataset_spec(args.data))
    torch.manual_seed(args.seed)
    model = build_model(args.model, dataset.input_shape, dataset.num_classes).to(args.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loader = ShardLoader(dataset, range(len(dataset.train_y)), args.batch_size, seed=args.seed)
    steps = args.epochs * -(-len(dataset.train_y) // args.batch_size)
    loss_fn = torch.nn.CrossEntropyLoss()
    start = time.perf_counter()
    model.train()
    for _ in range(steps):
        x, y = loader.next_batch()
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x.to(args.device)), y.to(args.device)).backward()
        optimizer.step()
    train_time = time.perf_counter() - start
    result = evaluate_model(model, dataset, args.device)
    return {"accuracy": result.accuracy, "f1": result.f1, "train_time": train_time,
            "total_time": time.perf_counter() - start}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def network(args, folder: Path, aggregate_every: str, lr: float, algorithm: str) -> dict:
    """Bootstrap + providers + requester, each a process; returns the task's metrics and wall time."""
    env = {**os.environ, "MESHLEARN_SECRET": SECRET, "OMP_NUM_THREADS": str(args.threads_per_provider)}
    port = _free_port()
    procs = []

    def spawn(name, *cmd):
        log = open(folder / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "meshlearn", *cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        procs.append(proc)
        return proc
    try:
        spawn("bootstrap", "bootstrap", "--port", str(port), "--state", str(folder / "registry.sqlite"))
        time.sleep(2)
        for i in range(args.providers):
            spawn(f"p{i}", "provider", "--bootstrap", f"127.0.0.1:{port}", "--id", f"p{i}",
                  "--workdir", str(folder / f"p{i}"), "--device", args.device)
        deadline = time.monotonic() + 120
        while sum("registered with" in (folder / f"p{i}.log").read_text() for i in range(args.providers)) < args.providers:
            if time.monotonic() > deadline:
                raise RuntimeError("providers did not register")
            time.sleep(0.5)
        start = time.perf_counter()
        request = subprocess.run(
            [sys.executable, "-m", "meshlearn", "request", "--bootstrap", f"127.0.0.1:{port}", "--data", args.data,
             "--model", args.model, "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
             "--lr", str(lr), "--providers", str(args.providers), "--aggregate-every", aggregate_every,
             "--momentum", str(args.momentum), *ALGORITHM_FLAGS.get(algorithm, ["--algorithm", algorithm]),
             "--fedavg-fraction", str(args.fedavg_fraction), "--seed", str(args.seed),
             "--output", str(folder / "result")],
            env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if request.returncode != 0:
            raise RuntimeError(f"request failed:\n{request.stdout}\n{request.stderr}")
        metrics = json.loads((folder / "result" / "metrics.json").read_text())
        return {"accuracy": metrics["accuracy"], "f1": metrics["f1"], "train_time": metrics["training_time"],
                "total_time": wall}
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "datasets" / "cifar10-jpeg.tar.gz"))
    parser.add_argument("--model", default="simplecnn")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--momentum", type=float, default=0.0, help="SGD momentum of both runs")
    parser.add_argument("--providers", type=int, default=4)
    parser.add_argument("--variants", nargs="+",
                        default=["epoch:0.01", "epoch:0.01:leader-sync", "epoch:0.01:fedavg", "epoch:0.01:dpsgd"],
                        help="network runs as AGGREGATE_EVERY:LR[:ALGORITHM] (default: each of leader, leader-sync, "
                        "fedavg and dpsgd at epoch:0.01)")
    parser.add_argument("--fedavg-fraction", type=float, default=1.0, help="fedavg's share of models per cycle")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads-per-provider", type=int, default=1)
    parser.add_argument("--baseline-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=90)
    args = parser.parse_args()
    base = single_process(args)
    runs = [("single process", base)]
    for variant in args.variants:
        every, lr, algorithm = (variant.split(":") + ["leader"])[:3]
        with tempfile.TemporaryDirectory(prefix="meshlearn-cloudmesh-") as tmp:
            runs.append((f"network ({algorithm}), {args.providers} providers, aggregate every {every}, lr {lr}",
                         network(args, Path(tmp), every, float(lr), algorithm)))
    print(f"{args.model}, {args.epochs} epoch(s), batch {args.batch_size}, baseline lr {args.lr}, "
          f"momentum {args.momentum}, "
          f"{os.cpu_count()} cores, {args.device}")
    print("| run | accuracy | F1 | training time (s) | total time (s) | time / single process |")
    print("|---|---|---|---|---|---|")
    for name, r in runs:
        print(f"| {name} | {r['accuracy']:.4f} | {r['f1']:.4f} | {r['train_time']:.1f} | {r['total_time']:.1f} "
              f"| {r['total_time'] / base['total_time']:.2f} |")


if __name__ == "__main__":
    main()
