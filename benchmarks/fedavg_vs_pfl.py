"""One FedAvg job, side by side: meshlearn's batched engine against Apple's pfl-research (pfl 0.6.0).

Fashion-MNIST split IID over C clients; meshlearn's `mlp` (784-128-64-10); local plain SGD, lr 0.05,
batch 32, 10 local steps per round (`--rounds`); 20 central iterations (`--iterations`); FedAvg weighted
by training samples, server learning rate 1 (plain averaging); C x F clients drawn per iteration. Two
configurations by default: 100 clients all taking part, and 1,000 clients of which 10% take part.

Both systems run the same job as child processes, alternating (meshlearn, pfl, meshlearn, pfl, ...
for `--repeats`), each measured for CPU seconds (user + sys, `os.wait4`), wall seconds, peak PSS
(`/proc/PID/smaps_rollup` of the child and its descendants, every 0.2 s) and the central model's final
accuracy on the 10,000 test images. The two start alike: the driver draws with meshlearn's own code
the client split (`--partition iid`), each iteration's cohort (FedAvg's seeded draw) and the initial
weights (`torch.manual_seed(seed)`, then `build_model`), and hands them to the pfl job
(`pfl_fedavg_job.py` beside this file), which imports pfl, torch and numpy only.

pfl is installed in its own virtual environment (`--venv`, default `benchmarks/.venv-pfl`), made with
`--system-site-packages` so that it uses the system's torch; without a package registry the pfl side
is skipped. Without the data folder the benchmark skips itself (exit 0).

    python benchmarks/fedavg_vs_pfl.py [--data ../shared/datasets/fashion-mnist] [--clients C --fraction F]
        [--iterations 20] [--rounds 10] [--repeats 1] [--seed 1] [--venv benchmarks/.venv-pfl] [--no-pfl]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
JOB = HERE / "pfl_fedavg_job.py"
PFL = "pfl==0.6.0"
CONFIGS = ((100, 1.0), (1000, 0.1))
LR, BATCH, SERVER_LR = 0.05, 32, 1.0
FLOPS_LIMIT = 100e9  # the reference machine: 100 GFLOP/s
POLL = 0.2  # seconds between PSS samples

sys.path.insert(0, str(SRC))


def meshlearn_env() -> dict:
    """The environment of a meshlearn child: this checkout's sources first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


def ensure_pfl(venv: Path) -> Path | None:
    """The python of a virtual environment holding pfl 0.6.0 (made and installed if need be), or None
    (with one line said) when it cannot be had."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import pfl.model.pytorch, pfl.version as v; assert v.__version__ == '0.6.0'"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    steps = {f"python3 -m venv {venv}": [sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
             f"pip install {PFL}": [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", PFL]}
    for name, step in steps.items():
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"pfl skipped: {name} failed ({tail})")
            return None
    if subprocess.run(check, capture_output=True).returncode:
        print(f"pfl skipped: {PFL} installed in {venv} but its PyTorch backend does not import")
        return None
    return python


def prepare_job(folder: Path, data: Path, clients: int, fraction: float, args) -> dict:
    """Write the pfl job's inputs into ``folder`` from meshlearn's own code: the decoded data, the
    IID split and the cohorts meshlearn draws, the initial weights, the hyperparameters. Each client's
    samples are stored in the order meshlearn's loader first draws them (``ShardLoader``'s first
    permutation): pfl takes a client's batches in stored order, so the first central iteration is the
    same computation in both. Returns the facts the report needs (cohort size, FLOPs per local step)."""
    import numpy as np
    import torch

    from meshlearn.data import load_dataset, loader_seed, partition_dataset
    from meshlearn.definitions.fedavg import participants
    from meshlearn.models import build_model
    from meshlearn.models.cost import step_flops

    dataset = load_dataset(f"fashion-mnist:{data}")
    parts = [part[torch.randperm(len(part), generator=torch.Generator().manual_seed(loader_seed(args.seed, rank)))
                  .numpy()] for rank, part in enumerate(partition_dataset(dataset, clients, "iid", args.seed))]
    cohorts = np.array([participants(args.seed, i, clients, fraction) for i in range(args.iterations)])
    torch.manual_seed(args.seed)
    model = build_model("mlp", dataset.input_shape, dataset.num_classes)
    folder.mkdir(parents=True)
    np.savez(folder / "data.npz", **{name: np.asarray(getattr(dataset, name).numpy())
                                     for name in ("train_x", "train_y", "test_x", "test_y")})
    np.savez(folder / "split.npz", cohorts=cohorts, **{f"part_{i}": part for i, part in enumerate(parts)})
    torch.save(model.state_dict(), folder / "init.pt")
    job = {"seed": args.seed, "clients": clients, "cohort": cohorts.shape[1], "iterations": args.iterations,
           "steps": args.rounds, "batch_size": BATCH, "lr": LR, "server_lr": SERVER_LR,
           "mean": float(dataset.mean[0]), "std": float(dataset.std[0])}
    (folder / "job.json").write_text(json.dumps(job))
    return {"cohort": job["cohort"], "step_flops": step_flops(model, dataset.normalize(dataset.train_x[:1])[0], BATCH)}


def descendants(root: int) -> list[int]:
    """``root`` and every live process below it (from each process's parent in /proc/*/stat)."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def pss_mb(root: int) -> float:
    """The summed proportional set size, in MB, of ``root`` and its descendants."""
    total = 0
    for pid in descendants(root):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
                    break
        except (OSError, ValueError):
            continue
    return total / 1024


def measure(command: list[str], env: dict, log: Path) -> dict:
    """Run ``command``; its CPU seconds (user + sys, itself and the descendants it waited for), wall
    seconds, peak PSS in MB, the 1-minute load average at its start, and its stdout."""
    load = float(Path("/proc/loadavg").read_text().split()[0])
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=out, stderr=err)
        peak, finished = 0.0, threading.Event()

        def sample():
            nonlocal peak
            while not finished.wait(POLL):
                peak = max(peak, pss_mb(child.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        finished.set()
        sampler.join()
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({child.returncode}):\n"
                           f"{log.with_suffix('.err').read_text()[-3000:]}")
    return {"cpu": usage.ru_utime + usage.ru_stime, "wall": wall, "pss": peak, "load": load,
            "stdout": log.with_suffix(".out").read_text()}


def run_meshlearn(data: Path, clients: int, fraction: float, args, output: Path) -> dict:
    """One `meshlearn simulate` of the job (batched engine); its measures and final test accuracy."""
    command = [sys.executable, "-m", "meshlearn", "simulate", "--quiet", "--engine", "batched",
               "--nodes", str(clients), "--algorithm", "fedavg", "--fedavg-fraction", str(fraction),
               "--dataset", f"fashion-mnist:{data}", "--model", "mlp", "--partition", "iid",
               "--rounds", str(args.rounds), "--batch-size", str(BATCH), "--lr", str(LR),
               "--iterations", str(args.iterations), "--test-after", str(args.iterations),
               "--seed", str(args.seed), "--output", str(output)]
    result = measure(command, meshlearn_env(), output.with_name(output.name + "-log"))
    per_node = json.loads((output / "summary.json").read_text())["per_node"]
    accuracies = {node["metrics"]["accuracy"] for node in per_node.values() if node.get("metrics")}
    if len(accuracies) != 1:
        print(f"note: meshlearn's nodes disagree on accuracy ({min(accuracies):.4f}..{max(accuracies):.4f})")
    return {**result, "accuracy": statistics.mean(accuracies)}


def run_pfl(python: Path, folder: Path, output: Path) -> dict:
    """One pfl job on the inputs in ``folder``; its measures and final test accuracy."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = measure([str(python), str(JOB), str(folder)], env, output)
    return {**result, "accuracy": json.loads(result["stdout"].strip().splitlines()[-1])["accuracy"]}


def table(rows: list[dict]) -> str:
    """The runs as a Markdown table."""
    lines = ["| system | clients | fraction | CPU s | wall s | peak PSS MB | accuracy | load at start |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['system']} | {r['clients']} | {r['fraction']:g} | {r['cpu']:.1f} | {r['wall']:.1f} | "
                     f"{r['pss']:.0f} | {r['accuracy']:.4f} | {r['load']:.2f} |")
    return "\n".join(lines)


def ratios(rows: list[dict]) -> list[str]:
    """Per configuration: meshlearn / pfl of the median CPU seconds (and of wall seconds)."""
    lines = []
    for clients, fraction in dict.fromkeys((r["clients"], r["fraction"]) for r in rows):
        of = {system: [r for r in rows if (r["system"], r["clients"], r["fraction"]) == (system, clients, fraction)]
              for system in ("meshlearn", "pfl")}
        if of["meshlearn"] and of["pfl"]:
            cpu = [statistics.median(r["cpu"] for r in of[s]) for s in ("meshlearn", "pfl")]
            wall = [statistics.median(r["wall"] for r in of[s]) for s in ("meshlearn", "pfl")]
            lines.append(f"- {clients} clients, fraction {fraction:g}: meshlearn/pfl CPU seconds "
                         f"**{cpu[0] / cpu[1]:.2f}** (wall {wall[0] / wall[1]:.2f})")
    return lines


def flop_reference(clients: int, fraction: float, facts: dict, args) -> str:
    """The FLOP limit: node-steps x FLOPs per step at 100 GFLOP/s."""
    node_steps = facts["cohort"] * args.rounds * args.iterations
    seconds = node_steps * facts["step_flops"] / FLOPS_LIMIT
    return (f"- {clients} clients, fraction {fraction:g}: {node_steps:,} node-steps x {facts['step_flops']:,} FLOPs "
            f"= {seconds:.3g} s at 100 GFLOP/s")


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "datasets" / "fashion-mnist",
                        help="folder of Fashion-MNIST's IDX files (default: ../shared/datasets/fashion-mnist)")
    parser.add_argument("--clients", type=int, help="one configuration: this many clients (with --fraction)")
    parser.add_argument("--fraction", type=float, help="one configuration: the share drawn per iteration")
    parser.add_argument("--iterations", type=int, default=20, help="central iterations (default 20)")
    parser.add_argument("--rounds", type=int, default=10, help="local steps per iteration (default 10)")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each system per configuration")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--venv", type=Path, default=HERE / ".venv-pfl", help="pfl's virtual environment")
    parser.add_argument("--no-pfl", action="store_true", help="run the meshlearn side only")
    args = parser.parse_args()
    if (args.clients is None) != (args.fraction is None):
        parser.error("--clients and --fraction go together")
    return args


def main() -> None:
    args = parse()
    data = args.data.resolve()
    if not (data / "train-images-idx3-ubyte.gz").is_file() and not (data / "train-images-idx3-ubyte").is_file():
        print(f"skipped: no Fashion-MNIST IDX files in {data}")
        return
    python = None if args.no_pfl else ensure_pfl(args.venv)
    configs = CONFIGS if args.clients is None else ((args.clients, args.fraction),)
    rows, references = [], []
    with tempfile.TemporaryDirectory(prefix="fedavg-vs-pfl-") as tmp:
        for clients, fraction in configs:
            folder = Path(tmp) / f"job-{clients}-{fraction:g}"
            facts = prepare_job(folder, data, clients, fraction, args)
            references.append(flop_reference(clients, fraction, facts, args))
            for repeat in range(args.repeats):
                runs = [("meshlearn", lambda o: run_meshlearn(data, clients, fraction, args, o))]
                if python is not None:
                    runs.append(("pfl", lambda o: run_pfl(python, folder, o)))
                for system, run in runs:
                    result = run(folder / f"{system}-{repeat}")
                    rows.append({"system": system, "clients": clients, "fraction": fraction, **result})
                    print(f"{system} {clients} x {fraction:g} #{repeat + 1}: {result['cpu']:.1f} CPU s, "
                          f"{result['wall']:.1f} s, {result['pss']:.0f} MB, accuracy {result['accuracy']:.4f}",
                          flush=True)
    print(f"\nFedAvg on Fashion-MNIST, mlp, {args.iterations} iterations x {args.rounds} local steps of {BATCH}, "
          f"lr {LR}, seed {args.seed}\n")
    print(table(rows))
    print("\nmeshlearn / pfl:\n" + ("\n".join(ratios(rows)) or "- (no pfl runs)"))
    print("\nFLOP limit (forward + backward matrix products only):\n" + "\n".join(references))


if __name__ == "__main__":
    main()
