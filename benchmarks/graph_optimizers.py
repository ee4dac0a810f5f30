"""Optimizers over graphs against one model, at equal samples: D-PSGD with each node's own
optimizer, GT-Adam, Adam with mixed moments and QG-DSGDm (``definitions``), each at its best
learning rate from a sweep, beside one model trained alone on batches as large as all the nodes'
together (as many steps: the same samples seen).

``lm``: gpt-tiny on pystdlib (context 64, 8 nodes of 16 windows, 300 iterations, cosine schedule
with 30 warm-up steps), on a 3-regular graph and a ring; validation perplexity on 512 held-out
windows (lower is better). ``fmnist``: Fashion-MNIST split by label with Dirichlet 0.1 over 16 nodes
on a ring, simplecnn; test accuracy on 2,000 test images, evenly spaced (higher is better).

Each (run, graph) is swept over ``--lrs`` (its own grid: the Adam family's, or SGD's) at the first
seed; the best is run at the other seeds. Every finished run is appended to ``--record`` (JSON
lines) and skipped when the benchmark is started again, so a long sweep resumes where it stopped.
The table gives each run's mean ± std over the seeds and its ratio to the one model's (of the
nodes' own models: the sweep chooses by it), and the nodes' average model's (the batched engine's
``average_model``: what the nodes would agree on by averaging alone once training stops).

Runs named ``-agK`` average K times an iteration with accelerated gossip (``--mixing-steps K
--mixing-accelerated true``); a trailing ``s`` minimises the pooled samples' loss (``--objective
samples``). Every run keeps the same samples and gradient steps.

    python3 benchmarks/graph_optimizers.py lm [--graphs regular:3 ring] [--seeds 90 91 92]
        [--runs one dpsgd gtadam dadam qgdsgdm] [--iterations 300] [--record FILE]
    python3 benchmarks/graph_optimizers.py fmnist --data ../shared/datasets/fashion-mnist [...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from language_model import meshlearn_run, plain_loop  # noqa: E402

from meshlearn.data import load_dataset  # noqa: E402


@dataclass(frozen=True)
class Optimizer:
    """One column of the comparison: an algorithm with the optimizer its rule takes."""

    name: str
    algorithm: str  # "" for the one model
    optimizer: str
    momentum: float
    adam_family: bool  # swept over the Adam grid, else over SGD's
    mixing_steps: int = 1  # exchanges with the neighbours an iteration
    accelerated: bool = False  # accelerated gossip over them (``definitions.mixing``)
    objective: str = "nodes"  # or "samples": each node's gradients by its share of the samples


RUNS = {
    "one": Optimizer("one model, batches from the pooled data as large as the nodes' together", "", "adamw", 0.0,
                     True),
    "dpsgd": Optimizer("D-PSGD, each node's AdamW", "dpsgd", "adamw", 0.0, True),
    "dpsgdm": Optimizer("D-PSGD, SGD momentum 0.9", "dpsgd", "sgd", 0.9, False),
    "gtadam": Optimizer("GT-Adam (AdamW)", "gtadam", "adamw", 0.0, True),
    "dadam": Optimizer("AdamW, mixed moments", "dadam", "adamw", 0.0, True),
    "qgdsgdm": Optimizer("QG-DSGDm (momentum 0.9)", "qgdsgdm", "sgd", 0.9, False),
    "gtsgdm": Optimizer("gradient tracking into SGD momentum 0.9", "gtadam", "sgd", 0.9, False),
    "onesgdm": Optimizer("one model, SGD momentum 0.9", "", "sgd", 0.9, False),
    # DeTAG's answer to a slowly mixing graph: several exchanges an iteration, accelerated (ten: 0.72^10 = 0.04
    # of the disagreement left on a ring of 16, against 0.95 after one plain exchange)
    "gtadam-ag10": Optimizer("GT-Adam (AdamW), 10 accelerated exchanges", "gtadam", "adamw", 0.0, True, 10, True),
    "gtadam-ag20": Optimizer("GT-Adam (AdamW), 20 accelerated exchanges", "gtadam", "adamw", 0.0, True, 20, True),
    # the pooled samples' loss, as the one model minimises it (``definitions.objective``): over a label-skewed
    # split equal batches from every node over-represent the small shards' classes
    "gtadam-s": Optimizer("GT-Adam (AdamW), the samples' loss", "gtadam", "adamw", 0.0, True, 1, False, "samples"),
    "gtadam-ag20s": Optimizer("GT-Adam (AdamW), 20 accelerated exchanges, the samples' loss", "gtadam", "adamw", 0.0,
                              True, 20, True, "samples"),
}


@dataclass(frozen=True)
class Task:
    """What every run of a benchmark shares."""

    metric: str  # "perplexity" (lower is better) or "accuracy"
    nodes: int
    batch: int
    iterations: int
    schedule: str
    values: dict  # meshlearn settings beyond the optimizer's
    adam_lrs: tuple[float, ...]
    sgd_lrs: tuple[float, ...]

    def better(self, a: float, b: float) -> bool:
        return a < b if self.metric == "perplexity" else a > b


def task_of(args: argparse.Namespace) -> Task:
    if args.what == "lm":
        return Task("perplexity", 8, 16, args.iterations, "cosine:warmup=30,min=0.05",
                    {"dataset": "pystdlib", "model": "gpt-tiny", "context": 64, "eval_samples": 512},
                    tuple(args.lrs or (1.5e-3, 3e-3, 6e-3)), tuple(args.sgd_lrs or (0.05, 0.1, 0.2)))
    return Task("accuracy", 16, 32, args.iterations, "constant",
                {"dataset": f"fashion-mnist:{args.data}", "model": "simplecnn", "partition": "dirichlet:0.1",
                 "eval_samples": 2000},
                tuple(args.lrs or (5e-4, 1e-3, 2e-3)), tuple(args.sgd_lrs or (0.01, 0.02, 0.05)))


def measure(task: Task, run: Optimizer, graph: str, lr: float, seed: int, folder: Path) -> tuple[float, float]:
    """One run's final metric: the mean over the nodes' models for a decentralized one, and the
    nodes' average model's (the batched engine's ``average_model``); the one model's twice."""
    if not run.algorithm:
        dataset = load_dataset(task.values["dataset"], context=task.values.get("context", 128))
        evaluation, _ = plain_loop(task.iterations, task.nodes * task.batch, task.values.get("context", 1),
                                   task.values["eval_samples"], run.optimizer, lr, run.momentum, task.schedule, seed,
                                   dataset=dataset, model_name=task.values["model"])
        return getattr(evaluation, task.metric), getattr(evaluation, task.metric)
    name = f"{run.algorithm}-{run.mixing_steps}-{run.objective}-{graph}-{lr}-{seed}"
    summary = meshlearn_run(folder / name, engine="batched", algorithm=run.algorithm, nodes=task.nodes,
                            topology=graph, batch_size=task.batch, iterations=task.iterations,
                            test_after=task.iterations, optimizer=run.optimizer, lr=lr,
                            momentum=run.momentum, lr_schedule=task.schedule, seed=seed, step_time=0.01,
                            mixing_steps=run.mixing_steps, mixing_accelerated=run.accelerated,
                            objective=run.objective, **task.values)
    return float(summary["final"][task.metric]), float(summary["average_model"][task.metric])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("lm", "fmnist"))
    parser.add_argument("--data", default="../shared/datasets/fashion-mnist", help="fmnist: the IDX files' folder")
    parser.add_argument("--graphs", nargs="+", default=None, help="lm: regular:3 ring; fmnist: ring")
    parser.add_argument("--runs", nargs="+", default=None, choices=sorted(RUNS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[90, 91, 92])
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--lrs", type=float, nargs="+", default=None, help="the Adam family's grid")
    parser.add_argument("--sgd-lrs", type=float, nargs="+", default=None, help="SGD's grid")
    parser.add_argument("--record", type=Path, default=None, help="JSON lines of finished runs (default: "
                        "benchmarks/results/graph_optimizers-WHAT.jsonl)")
    args = parser.parse_args()
    task = task_of(args)
    graphs = args.graphs or (["regular:3", "ring"] if args.what == "lm" else ["ring"])
    names = args.runs or (["one", "dpsgd", "gtadam", "dadam", "qgdsgdm"] if args.what == "lm" else
                          ["one", "onesgdm", "dpsgdm", "dpsgd", "gtadam", "dadam", "qgdsgdm"])
    record = args.record or Path(__file__).parent / "results" / f"graph_optimizers-{args.what}.jsonl"
    record.parent.mkdir(parents=True, exist_ok=True)
    done = {}
    if record.exists():
        for line in record.read_text().splitlines():
            entry = json.loads(line)
            done[(entry["run"], entry["graph"], entry["lr"], entry["seed"], entry["iterations"])] = \
                entry["value"], entry.get("average")  # records before the average model was measured: None

    def value(name: str, graph: str, lr: float, seed: int, folder: Path) -> float:
        """The run's metric over the nodes' models (what the sweep chooses by); its average model's
        is kept beside it in ``done``."""
        key = (name, graph if RUNS[name].algorithm else "-", lr, seed, task.iterations)
        if key not in done:
            started = time.perf_counter()
            done[key] = measure(task, RUNS[name], graph, lr, seed, folder)
            with record.open("a") as out:
                out.write(json.dumps({"run": name, "graph": key[1], "lr": lr, "seed": seed,
                                      "iterations": task.iterations, "value": done[key][0], "average": done[key][1],
                                      "wall": round(time.perf_counter() - started, 1)}) + "\n")
            print(f"{name} {key[1]} lr {lr} seed {seed}: {task.metric} {done[key][0]:.4f}, average model "
                  f"{done[key][1]:.4f}", flush=True)
        return done[key][0]

    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for graph in graphs:
            for name in names:
                run = RUNS[name]
                if not run.algorithm and graph != graphs[0]:
                    continue  # the one model has no graph
                lrs = task.adam_lrs if run.adam_family else task.sgd_lrs
                swept = {lr: value(name, graph, lr, args.seeds[0], Path(folder)) for lr in lrs}
                best = swept[lrs[0]], lrs[0]
                for lr, result in swept.items():
                    if task.better(result, best[0]):
                        best = result, lr
                values = [best[0]] + [value(name, graph, best[1], seed, Path(folder)) for seed in args.seeds[1:]]
                averages = [done[(name, graph if run.algorithm else "-", best[1], seed, task.iterations)][1]
                            for seed in args.seeds]
                rows.append((run.name, graph if run.algorithm else "-", best[1], swept, values, averages))
    print(f"\n{args.what}: {task.nodes} nodes of batch {task.batch}, {task.iterations} iterations, {task.schedule}; "
          f"{task.metric}; lr swept at seed {args.seeds[0]}, the best run at seeds {', '.join(map(str, args.seeds))}")
    print(f"| run | graph | best lr (sweep: {task.metric}) | {task.metric} per seed | mean ± std | of one model's | "
          "average model per seed | its mean |")
    print("|---|---|---|---|---|---|---|---|")
    alone = [statistics.fmean(row[4]) for row in rows if row[1] == "-"]  # the one model's, at its best
    reference = (min if task.metric == "perplexity" else max)(alone) if alone else None
    for run_name, graph, lr, swept, values, averages in rows:
        mean = statistics.fmean(values)
        spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
        sweep = ", ".join(f"{k:g}: {v:.3f}" for k, v in swept.items())
        ratio = f"{mean / reference:.3f}" if reference and task.metric == "perplexity" else \
            (f"{mean - reference:+.4f}" if reference else "")
        measured = [a for a in averages if a is not None]  # records from before it was measured: not shown
        print(f"| {run_name} | {graph} | {lr:g} ({sweep}) | {', '.join(f'{v:.3f}' for v in values)} | "
              f"{mean:.3f}{spread} | {ratio} | {', '.join(f'{a:.3f}' for a in measured) or '-'} | "
              f"{statistics.fmean(measured) if measured else math.nan:.3f} |")


if __name__ == "__main__":
    main()
