"""gpt-tiny on the standard library: decentralized runs against one model trained alone, and
tokens per second per node against a plain PyTorch loop.

``quality``: 8 nodes (3-regular) train gpt-tiny with D-PSGD (batched engine), gossip and the
leader (process engine: the batched engine steps asynchronous nodes apart, which torch.optim's
AdamW cannot), each node ``--batch`` windows a step; beside them a plain PyTorch loop trains one
gpt-tiny on batches of 8 x ``--batch`` windows for as many steps: the same tokens. A seed's runs
start from the same model and are measured on the same held-out windows; the table gives each
run's validation perplexity and its ratio to the single model's, and with several ``--seeds``
(one model and D-PSGD run for each; gossip and the leader for the first only) each one's mean and
standard deviation over the seeds: one run's perplexity moves by 15-20% from seed to seed.

``speed``: training tokens a second, on both engines at 8 and 64 nodes (the batched engine: one
process; the process engine: one process per node): the machine's (all nodes together) and per
node, against a plain PyTorch loop using the whole machine.

    python3 benchmarks/language_model.py quality [--iterations 200] [--batch 16] [--context 64]
        [--optimizer adamw] [--lr 0.003] [--momentum 0] [--lr-schedule constant] [--seeds 90 ...]
    python3 benchmarks/language_model.py speed [--iterations 6] [--nodes 8 64] [--batched-workers 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from meshlearn.config import make_config
from meshlearn.data import load_dataset
from meshlearn.evaluation import evaluate_model
from meshlearn.metrics import Evaluation
from meshlearn.models import build_model
from meshlearn.optim import make_optimizer
from meshlearn.schedule import LrSchedule
from meshlearn.sgd import local_step
from meshlearn.sim import simulate
from meshlearn.tasks import task_of

SEED, LR, OPTIMIZER = 90, 0.003, "adamw"


def plain_loop(iterations: int, batch: int, context: int, eval_samples: int, optimizer: str = OPTIMIZER,
               lr: float = LR, momentum: float = 0.0, schedule: str = "constant", seed: int = SEED,
               dataset=None, model_name: str = "gpt-tiny", weight_decay: float = 0.0) -> tuple[Evaluation, float]:
    """One model (gpt-tiny on pystdlib unless ``dataset`` and ``model_name`` say another) trained alone
    on random ``batch``-sample batches: (its evaluation on the held-out set, training tokens a second,
    the first step left out of the timing)."""
    dataset = dataset or load_dataset("pystdlib", context=context)
    torch.manual_seed(seed)
    model = build_model(model_name, dataset.input_shape, dataset.num_classes)
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:  # the parameters as views of one row, as a node's FlatState keeps them
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    rows = make_optimizer(optimizer, flat.unsqueeze(0), lr, momentum, weight_decay)
    generator = torch.Generator().manual_seed(seed)
    loss_of = task_of(dataset).loss
    started = 0.0
    factors = LrSchedule.model_validate(schedule)
    for step in range(iterations):
        if step == 1:
            started = time.perf_counter()
        rows.set_lr(lr * factors.factor(step, iterations))
        chosen = torch.randint(0, len(dataset.train_x), (batch,), generator=generator)
        local_step(model, params, rows, dataset.normalize(dataset.train_x[chosen]), dataset.train_y[chosen], loss_of)
    seconds = time.perf_counter() - started
    return evaluate_model(model, dataset, limit=eval_samples), (iterations - 1) * batch * context / seconds


def meshlearn_run(output: Path, **values) -> dict:
    """A meshlearn simulation's summary."""
    config = make_config({"dataset": "pystdlib", "model": "gpt-tiny", "optimizer": OPTIMIZER, "lr": LR, "seed": SEED,
                          "output": str(output), "wait_timeout": 120, **values})
    simulate(config, progress=False)
    return json.loads((output / "summary.json").read_text())


def quality(args: argparse.Namespace) -> None:
    common = {"nodes": 8, "topology": "regular:3", "context": args.context, "batch_size": args.batch,
              "iterations": args.iterations, "test_after": args.iterations, "eval_samples": args.eval_samples,
              "optimizer": args.optimizer, "lr": args.lr, "momentum": args.momentum, "lr_schedule": args.lr_schedule}
    runs: dict[str, list[tuple[float, float]]] = {}  # run -> (perplexity, wall seconds) per seed
    alone = "one model, 8x the batch (plain PyTorch)"
    with tempfile.TemporaryDirectory() as folder:
        for index, seed in enumerate(args.seeds):
            started = time.perf_counter()
            evaluation, _ = plain_loop(args.iterations, 8 * args.batch, args.context, args.eval_samples,
                                       args.optimizer, args.lr, args.momentum, args.lr_schedule, seed)
            runs.setdefault(alone, []).append((evaluation.perplexity, time.perf_counter() - started))
            for name, engine, algorithm in (("D-PSGD", "batched", "dpsgd"), ("gossip", "process", "gossip"),
                                            ("leader", "process", "leader")):
                if index and algorithm != "dpsgd":  # gossip and the leader: the first seed only
                    continue
                started = time.perf_counter()
                summary = meshlearn_run(Path(folder) / f"{name}-{seed}", engine=engine, algorithm=algorithm,
                                        seed=seed, **common)
                runs.setdefault(f"{name}, 8 nodes ({engine} engine)", []).append(
                    (summary["final"]["perplexity"], time.perf_counter() - started))
    print(f"gpt-tiny on pystdlib, context {args.context}, {args.iterations} steps of {args.batch} windows a node "
          f"({args.optimizer}, lr {args.lr}, momentum {args.momentum}, lr schedule {args.lr_schedule}); validation: "
          f"{args.eval_samples} held-out windows; seeds {', '.join(map(str, args.seeds))}")
    print("| run | validation perplexity per seed | mean ± std | of the single model's (means) | wall s |")
    print("|---|---|---|---|---|")
    base = statistics.fmean(p for p, _ in runs[alone])
    for name, results in runs.items():
        values = [p for p, _ in results]
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        print(f"| {name} | {', '.join(f'{p:.3f}' for p in values)} | {statistics.fmean(values):.3f}{spread} | "
              f"{statistics.fmean(values) / base:.3f} | {sum(w for _, w in results):.0f} |")


def speed(args: argparse.Namespace) -> None:
    tokens = args.batch * args.context  # a node's training tokens a step
    print(f"gpt-tiny, context {args.context}, batch {args.batch} a node, one SGD step an iteration: training tokens a "
          f"second (the machine's: all nodes together, over an iteration's time; per node: that / nodes), against a "
          f"plain PyTorch loop using the whole machine ({torch.get_num_threads()} threads) on the same tokens a step "
          f"(nodes x batch)")
    print("| run | nodes | tokens/s, machine | tokens/s per node | of the plain loop's | wall s |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for nodes in args.nodes:
            _, alone = plain_loop(max(3, args.iterations), nodes * args.batch, args.context, 16, "sgd", 0.1)
            print(f"| plain PyTorch loop, batch {nodes * args.batch} | 1 | {alone:,.0f} | | 1.000 | |")
            for engine in ("batched", "process"):
                started = time.perf_counter()
                summary = meshlearn_run(Path(folder) / f"{engine}-{nodes}", engine=engine, nodes=nodes,
                                        topology="regular:3", context=args.context, batch_size=args.batch,
                                        iterations=args.iterations, eval_nodes=1, test_after=args.iterations,
                                        eval_samples=16, optimizer="sgd", lr=0.1,
                                        **({"step_time": 0.01, "batched_workers": args.batched_workers}
                                           if engine == "batched" else {}))
                wall = time.perf_counter() - started
                if engine == "batched":  # every node in one process: its wall-clock after start-up, per iteration
                    seconds = (summary["wall_clock"] - summary["startup"]) / args.iterations
                else:  # a process per node: a node's median iteration, its steps and its exchange
                    seconds = summary["iteration_time"]["total"]["median"]
                machine = nodes * tokens / seconds
                print(f"| meshlearn, {engine} engine | {nodes} | {machine:,.0f} | {machine / nodes:,.0f} | "
                      f"{machine / alone:.3f} | {wall:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--iterations", type=int, default=200)
    q.add_argument("--batch", type=int, default=16)
    q.add_argument("--context", type=int, default=64)
    q.add_argument("--eval-samples", type=int, default=512)
    q.add_argument("--optimizer", default=OPTIMIZER)
    q.add_argument("--lr", type=float, default=LR)
    q.add_argument("--momentum", type=float, default=0.0)
    q.add_argument("--lr-schedule", default="constant")
    q.add_argument("--seeds", type=int, nargs="+", default=[SEED])
    s = sub.add_parser("speed")
    s.add_argument("--iterations", type=int, default=6)
    s.add_argument("--batch", type=int, default=16)
    s.add_argument("--context", type=int, default=64)
    s.add_argument("--nodes", type=int, nargs="+", default=[8, 64])
    s.add_argument("--batched-workers", type=int, default=0, help="the batched engine's threads (0: auto, which "
                   "times its first steps on each count: a short run measures mostly those trials)")
    args = parser.parse_args()
    quality(args) if args.what == "quality" else speed(args)


if __name__ == "__main__":
    main()
