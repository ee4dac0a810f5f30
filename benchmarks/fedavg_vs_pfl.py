"""One FedAvg job, side by side: meshlearn's batched engine against Apple's pfl-research (pfl 0.6.0),
measured by the peer-benchmark rule of `benchmarks/README.md`.

Fashion-MNIST split IID over C clients; meshlearn's `mlp` (784-128-64-10); local plain SGD, lr 0.05,
batch 32, 10 local steps per round (`--rounds`); 20 central iterations (`--iterations`); FedAvg weighted
by training samples, server learning rate 1 (plain averaging); C x F clients drawn per iteration. Two
configurations by default: 100 clients all taking part, and 1,000 clients of which 10% take part.

The same job in both. The driver draws, with meshlearn's own code, the client split (`--partition
iid`), each iteration's cohort (FedAvg's seeded draw), the initial weights (`torch.manual_seed(seed)`,
then `build_model`) and every drawn client's batches: each client takes the next batches of its own
endless stream, reshuffled every epoch (`ShardLoaders`, as meshlearn's engine draws them; a client
not drawn draws nothing). The pfl job (`pfl_fedavg_job.py` beside this file; pfl, torch and numpy
only) trains on exactly those batches, so the two compute the same steps on the same samples, and
their final test accuracies agree to float rounding (the difference is printed). pfl's own
`Dataset` would restart a client's shard each time it is drawn (the same first 320 samples every
round); meshlearn's stream is kept, and pfl made to follow it. Each system decodes the IDX files
itself.

The rule, in short (`benchmarks/README.md`):
1. each system at its fastest setting on this machine: a calibration pass runs meshlearn on 1 and 2
   threads (`--batched-workers N`, OMP_NUM_THREADS=N) and pfl on 1 and 2 torch threads and as pfl's
   own distributed simulation with 2 processes of 1 thread (its guide's way to use more cores), all
   alternated, and keeps for each the setting of least CPU seconds (`--choose-by wall`: of least
   wall seconds); a candidate still running after 3x (+ 10 s) its system's best wall time so far is
   stopped, as not the fastest (pfl on 2 threads under load: 145 CPU s, 6 minutes, for a 19 CPU s job);
   `--meshlearn-threads` / `--pfl-setting` skip the calibration;
2. then `--pairs` (default 3) pairs of runs, ABAB with the order swapped every pair (meshlearn
   first in pair 1, pfl first in pair 2, ...);
3. per pair the ratio meshlearn / pfl of CPU seconds (user + sys of the process and the children it
   waited for, `os.wait4`) and of wall seconds; reported: every pair's ratio, their median and
   range, each run's peak PSS (the process tree, sampled every 0.2 s), the accuracies, and the
   1-minute load average at the start and end.

pfl is installed in its own virtual environment (`--venv`, default `benchmarks/.venv-pfl`, made if
missing: pfl 0.6.0 and, if the venv has none, the driver's own torch version); without it the pfl
side is skipped. Without the data folder the benchmark skips itself (exit 0).

    python benchmarks/fedavg_vs_pfl.py [--data ../shared/datasets/fashion-mnist] [--clients C --fraction F]
        [--pairs 3] [--iterations 20] [--rounds 10] [--seed 1] [--choose-by cpu|wall]
        [--meshlearn-threads 1|2] [--pfl-setting 1|2|2x1] [--venv benchmarks/.venv-pfl] [--no-pfl]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
JOB = HERE / "pfl_fedavg_job.py"
PFL_VERSION = "0.6.0"
CONFIGS = ((100, 1.0), (1000, 0.1))
LR, BATCH, SERVER_LR = 0.05, 32, 1.0
FLOPS_LIMIT = 100e9  # the reference machine: 100 GFLOP/s
POLL = 0.2  # seconds between PSS samples
STOP_AFTER = 3  # calibration: a candidate run is stopped after 3x (+ 10 s) its system's best wall time so far
AGREE = 0.005  # accuracies further apart than this are flagged: the two did not run the same job

sys.path.insert(0, str(SRC))


@dataclass(frozen=True)
class Setting:
    """How a system uses the cores: ``processes`` of ``threads`` torch intra-op threads each."""

    processes: int
    threads: int

    @property
    def name(self) -> str:
        return f"{self.threads}" if self.processes == 1 else f"{self.processes}x{self.threads}"

    def describe(self, system: str) -> str:
        if system == "meshlearn":
            return f"{self.threads} thread(s): --batched-workers {self.threads}, OMP_NUM_THREADS={self.threads}"
        if self.processes == 1:
            return f"{self.threads} thread(s): one process, torch.set_num_threads({self.threads})"
        return f"{self.processes} processes x {self.threads} thread: pfl's distributed simulation (PFL_WORKER_RANK)"

    @classmethod
    def parse(cls, text: str) -> Setting:
        processes, _, threads = text.rpartition("x")
        return cls(int(processes or 1), int(threads))


MESHLEARN_SETTINGS = (Setting(1, 1), Setting(1, 2))
PFL_SETTINGS = (Setting(1, 1), Setting(1, 2), Setting(2, 1))


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo), or the machine type."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def loadavg() -> float:
    """The 1-minute load average."""
    return float(Path("/proc/loadavg").read_text().split()[0])


def threads_env(env: dict, threads: int) -> dict:
    """``env`` with OpenMP and MKL held to ``threads``."""
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def meshlearn_env() -> dict:
    """The environment of a meshlearn child: this checkout's sources first on the path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")]))
    return env


def ensure_pfl(venv: Path) -> Path | None:
    """The python of a virtual environment holding pfl 0.6.0 (made and installed if need be), or None
    (with one line said) when it cannot be had. The venv gets the driver's torch version (from the
    package index pip is set up with) where it sees no torch of its own."""
    import torch

    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import pfl.model.pytorch, pfl.version as v; assert v.__version__ == '{PFL_VERSION}'"]
    if python.exists() and subprocess.run(check, capture_output=True, check=False).returncode == 0:
        return python
    base = getattr(sys, "_base_executable", sys.executable)
    steps = [(f"python3 -m venv {venv}", [base, "-m", "venv", "--system-site-packages", str(venv)])]
    has_torch = python.exists() and subprocess.run([str(python), "-c", "import torch"], capture_output=True, check=False).returncode == 0
    packages = [f"pfl=={PFL_VERSION}"] + ([] if has_torch else [f"torch=={torch.__version__.split('+')[0]}"])
    steps.append((f"pip install {' '.join(packages)}",
                  [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *packages]))
    for name, step in steps:
        if name.startswith("python3 -m venv") and python.exists():
            continue
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["?"])[-1]
            print(f"pfl skipped: {name} failed ({tail})")
            return None
    if subprocess.run(check, capture_output=True, check=False).returncode:
        print(f"pfl skipped: pfl {PFL_VERSION} installed in {venv} but its PyTorch backend does not import")
        return None
    return python


def versions(python: Path | None) -> str:
    """torch's version here and pfl's and torch's in pfl's venv."""
    import torch

    line = f"meshlearn side: torch {torch.__version__}"
    if python is not None:
        done = subprocess.run([str(python), "-c", "import pfl.version as v, torch; print(v.__version__, torch.__version__)"],
                              capture_output=True, text=True, check=False)
        pfl, ptorch = (done.stdout.split() + ["?", "?"])[:2]
        line += f"; pfl side: pfl {pfl}, torch {ptorch}"
    return line


def prepare_job(folder: Path, data: Path, clients: int, fraction: float, args) -> dict:
    """Write the pfl job's inputs into ``folder`` from meshlearn's own code: the cohorts FedAvg draws,
    the initial weights, the hyperparameters, and every drawn client's batches in each iteration, as
    meshlearn's batched engine draws them (``ShardLoaders`` over the seeded split, each node seeded
    with ``loader_seed``; only drawn nodes draw, ``rounds`` batches each). Returns the facts the report
    needs (cohort size, FLOPs per local step)."""
    import numpy as np
    import torch

    from meshlearn.data import (
        ShardLoaders,
        load_dataset,
        loader_seed,
        partition_dataset,
    )
    from meshlearn.definitions.fedavg import participants
    from meshlearn.models import build_model
    from meshlearn.models.cost import step_flops

    dataset = load_dataset(f"fashion-mnist:{data}")
    parts = partition_dataset(dataset, clients, "iid", args.seed)
    cohorts = np.array([participants(args.seed, i, clients, fraction) for i in range(args.iterations)])
    loaders = ShardLoaders(parts, BATCH, [loader_seed(args.seed, rank) for rank in range(clients)])
    sizes = np.zeros((*cohorts.shape, args.rounds), dtype=np.int64)
    chunks: list[list[list[np.ndarray]]] = []
    for t, cohort in enumerate(cohorts):
        column = {int(client): j for j, client in enumerate(cohort)}
        drawn: list[list[np.ndarray]] = [[] for _ in cohort]
        for step in range(args.rounds):
            for members, picks in loaders.next(None if fraction >= 1 else cohort.tolist()):
                for member, pick in zip(members.tolist(), picks):
                    drawn[column[member]].append(pick)
                    sizes[t, column[member], step] = len(pick)
        chunks.append(drawn)
    picks = np.concatenate([pick for drawn in chunks for batches in drawn for pick in batches]).astype(np.int32)
    torch.manual_seed(args.seed)
    model = build_model("mlp", dataset.input_shape, dataset.num_classes)
    folder.mkdir(parents=True)
    np.savez(folder / "split.npz", cohorts=cohorts, sizes=sizes, picks=picks,
             shards=np.array([len(part) for part in parts], dtype=np.int64))
    torch.save(model.state_dict(), folder / "init.pt")
    job = {"seed": args.seed, "clients": clients, "cohort": cohorts.shape[1], "iterations": args.iterations,
           "steps": args.rounds, "batch_size": BATCH, "lr": LR, "server_lr": SERVER_LR,
           "mean": float(dataset.mean[0]), "std": float(dataset.std[0]), "data": str(data)}
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


def measure(command: list[str], env: dict, log: Path, limit: float | None = None) -> dict:
    """Run ``command``; its CPU seconds (user + sys, itself and the descendants it waited for), wall
    seconds, peak PSS in MB, the 1-minute load average at its start, and its stdout. With ``limit``,
    a run still going after ``limit`` wall seconds is stopped (its process group killed) and marked
    ``stopped``: its CPU seconds are then a lower bound."""
    load = loadavg()
    with open(log.with_suffix(".out"), "w") as out, open(log.with_suffix(".err"), "w") as err:
        start = time.perf_counter()
        child = subprocess.Popen(command, env=env, stdout=out, stderr=err, start_new_session=True)
        peak, finished, stopped = 0.0, threading.Event(), threading.Event()

        def sample():
            nonlocal peak
            while not finished.wait(POLL):
                peak = max(peak, pss_mb(child.pid))
                if limit is not None and time.perf_counter() - start > limit and not stopped.is_set():
                    stopped.set()
                    for pid in descendants(child.pid):
                        with contextlib.suppress(OSError):
                            os.kill(pid, signal.SIGKILL)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        finished.set()
        sampler.join()
    result = {"cpu": usage.ru_utime + usage.ru_stime, "wall": wall, "pss": peak, "load": load,
              "stdout": log.with_suffix(".out").read_text(), "stopped": stopped.is_set()}
    code = os.waitstatus_to_exitcode(status)
    if code and not result["stopped"]:
        raise RuntimeError(f"{' '.join(command[:4])} ... failed ({code}):\n{log.with_suffix('.err').read_text()[-3000:]}")
    return result


def run_meshlearn(data: Path, clients: int, fraction: float, setting: Setting, args, output: Path,
                  limit: float | None = None) -> dict:
    """One `meshlearn simulate` of the job (batched engine); its measures and final test accuracy."""
    command = [sys.executable, "-m", "meshlearn", "simulate", "--quiet", "--engine", "batched",
               "--batched-workers", str(setting.threads),
               "--nodes", str(clients), "--algorithm", "fedavg", "--fedavg-fraction", str(fraction),
               "--dataset", f"fashion-mnist:{data}", "--model", "mlp", "--partition", "iid",
               "--rounds", str(args.rounds), "--batch-size", str(BATCH), "--lr", str(LR),
               "--iterations", str(args.iterations), "--test-after", str(args.iterations),
               "--seed", str(args.seed), "--output", str(output)]
    result = measure(command, threads_env(meshlearn_env(), setting.threads), output.with_name(output.name + "-log"), limit)
    if result["stopped"]:
        return {**result, "accuracy": None}
    per_node = json.loads((output / "summary.json").read_text())["per_node"]
    accuracies = {node["metrics"]["accuracy"] for node in per_node.values() if node.get("metrics")}
    if len(accuracies) != 1:
        print(f"note: meshlearn's nodes disagree on accuracy ({min(accuracies):.4f}..{max(accuracies):.4f})")
    return {**result, "accuracy": statistics.mean(accuracies)}


def run_pfl(python: Path, folder: Path, setting: Setting, output: Path, limit: float | None = None) -> dict:
    """One pfl job on the inputs in ``folder``; its measures and final test accuracy."""
    env = threads_env({k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, setting.threads)
    command = [str(python), str(JOB), str(folder), "--threads", str(setting.threads),
               "--processes", str(setting.processes)]
    result = measure(command, env, output, limit)
    if result["stopped"]:
        return {**result, "accuracy": None}
    return {**result, "accuracy": json.loads(result["stdout"].strip().splitlines()[-1])["accuracy"]}


def spread(values: list[float]) -> str:
    """``median (min-max)`` of ``values``."""
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


class Job:
    """One configuration's runs: calibration, then alternated pairs."""

    def __init__(self, data: Path, folder: Path, clients: int, fraction: float, python: Path | None, args):
        self.data, self.folder, self.clients, self.fraction, self.python, self.args = \
            data, folder, clients, fraction, python, args
        self.count = 0

    def run(self, system: str, setting: Setting, limit: float | None = None) -> dict:
        """One run of ``system`` on ``setting`` (stopped after ``limit`` wall seconds), said as it ends."""
        self.count += 1
        output = self.folder / f"{system}-{self.count}"
        if system == "meshlearn":
            result = run_meshlearn(self.data, self.clients, self.fraction, setting, self.args, output, limit)
        else:
            result = run_pfl(self.python, self.folder, setting, output, limit)
        accuracy = "stopped" if result["stopped"] else f"{result['accuracy']:.4f}"
        print(f"  {system:9} {setting.name:>3}: {result['cpu']:6.1f} CPU s {result['wall']:6.1f} s wall "
              f"{result['pss']:6.0f} MB  accuracy {accuracy}  load {result['load']:.2f}", flush=True)
        return {"system": system, "setting": setting.name, **result}

    def calibrate(self, systems: dict[str, tuple[Setting, ...]]) -> dict[str, Setting]:
        """Each system's candidate settings, alternated between the systems; per system the one with
        the least ``choose_by`` (median over ``calibration_runs``)."""
        key = self.args.choose_by
        queue: list[tuple[str, Setting]] = []
        for round_ in range(self.args.calibration_runs):
            width = max(len(s) for s in systems.values())
            for k in range(width):
                order = list(systems) if (k + round_) % 2 == 0 else list(reversed(systems))
                queue += [(system, systems[system][k]) for system in order if k < len(systems[system])]
        measured: dict[tuple[str, str], list[float]] = {}
        best_wall: dict[str, float] = {}
        for system, setting in queue:
            # a candidate past STOP_AFTER times the system's best wall time so far is not its fastest
            limit = STOP_AFTER * best_wall[system] + 10 if system in best_wall else None
            result = self.run(system, setting, limit)
            measured.setdefault((system, setting.name), []).append(math.inf if result["stopped"] else result[key])
            if not result["stopped"]:
                best_wall[system] = min(best_wall.get(system, math.inf), result["wall"])
        chosen = {}
        for system, candidates in systems.items():
            chosen[system] = min(candidates, key=lambda s: statistics.median(measured[(system, s.name)]))
            said = ", ".join(f"{s.name}: {value:.1f}" if (value := statistics.median(measured[(system, s.name)])) < math.inf
                             else f"{s.name}: stopped" for s in candidates)
            print(f"  {system} {key} seconds by setting: {said} -> {chosen[system].describe(system)}")
        return chosen

    def pairs(self, chosen: dict[str, Setting]) -> list[dict]:
        """``pairs`` pairs, ABAB with the order swapped every pair."""
        systems = list(chosen)
        found = []
        for k in range(self.args.pairs):
            order = systems if k % 2 == 0 else list(reversed(systems))
            runs = {system: self.run(system, chosen[system]) for system in order}
            found.append({"first": order[0], **runs})
        return found


def report(clients: int, fraction: float, chosen: dict[str, Setting], pairs: list[dict], loads: tuple[float, float]) -> str:
    """One configuration's pairs as Markdown: the table, the ratios, the accuracies."""
    lines = [f"#### {clients} clients, fraction {fraction:g} (load {loads[0]:.2f} at the start, {loads[1]:.2f} at the end)",
             "", "settings: " + "; ".join(f"{s} {chosen[s].describe(s)}" for s in chosen), ""]
    systems = [s for s in ("meshlearn", "pfl") if s in chosen]
    if len(systems) == 2:
        lines += [("| pair | first | meshlearn CPU s | pfl CPU s | **CPU ratio** | meshlearn wall s | pfl wall s | wall ratio "
                   "| meshlearn / pfl peak PSS MB | accuracy meshlearn / pfl | load at start |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, pair in enumerate(pairs, 1):
            m, p = pair["meshlearn"], pair["pfl"]
            lines.append(f"| {k} | {pair['first']} | {m['cpu']:.1f} | {p['cpu']:.1f} | **{m['cpu'] / p['cpu']:.2f}** | "
                         f"{m['wall']:.1f} | {p['wall']:.1f} | {m['wall'] / p['wall']:.2f} | {m['pss']:.0f} / {p['pss']:.0f} | "
                         f"{m['accuracy']:.4f} / {p['accuracy']:.4f} | {min(m['load'], p['load']):.2f}-{max(m['load'], p['load']):.2f} |")
        cpu = [pair["meshlearn"]["cpu"] / pair["pfl"]["cpu"] for pair in pairs]
        wall = [pair["meshlearn"]["wall"] / pair["pfl"]["wall"] for pair in pairs]
        gaps = [abs(pair["meshlearn"]["accuracy"] - pair["pfl"]["accuracy"]) for pair in pairs]
        lines += ["", (f"meshlearn / pfl CPU seconds, median (range) of {len(pairs)} pairs: **{spread(cpu)}**; "
                       f"wall seconds: {spread(wall)}"),
                  (f"accuracy difference |meshlearn - pfl|: at most {max(gaps):.4f}"
                   + ("" if max(gaps) <= AGREE else f"  ** DISAGREE (over {AGREE}): not the same job **"))]
    else:
        lines += ["| run | meshlearn CPU s | wall s | peak PSS MB | accuracy | load at start |", "|---|---|---|---|---|---|"]
        for k, pair in enumerate(pairs, 1):
            m = pair["meshlearn"]
            lines.append(f"| {k} | {m['cpu']:.1f} | {m['wall']:.1f} | {m['pss']:.0f} | {m['accuracy']:.4f} | {m['load']:.2f} |")
    return "\n".join(lines)


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
    parser.add_argument("--pairs", "--repeats", type=int, default=3, dest="pairs",
                        help="alternated pairs of runs per configuration (default 3; at least 3 for a result)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--choose-by", choices=("cpu", "wall"), default="cpu",
                        help="what the calibration minimises for each system (default cpu: the measure compared)")
    parser.add_argument("--calibration-runs", type=int, default=1, help="runs of each candidate setting (default 1)")
    parser.add_argument("--meshlearn-threads", type=int, choices=(1, 2), help="skip calibrating meshlearn: this setting")
    parser.add_argument("--pfl-setting", choices=[s.name for s in PFL_SETTINGS],
                        help="skip calibrating pfl: 1 or 2 threads, or 2x1 (two processes of one thread)")
    parser.add_argument("--venv", type=Path, default=HERE / ".venv-pfl", help="pfl's virtual environment")
    parser.add_argument("--no-pfl", action="store_true", help="run the meshlearn side only")
    args = parser.parse_args()
    if (args.clients is None) != (args.fraction is None):
        parser.error("--clients and --fraction go together")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    return args


def main() -> None:
    args = parse()
    data = args.data.resolve()
    if not (data / "train-images-idx3-ubyte.gz").is_file() and not (data / "train-images-idx3-ubyte").is_file():
        print(f"skipped: no Fashion-MNIST IDX files in {data}")
        return
    python = None if args.no_pfl else ensure_pfl(args.venv)
    configs = CONFIGS if args.clients is None else ((args.clients, args.fraction),)
    print(f"FedAvg on Fashion-MNIST, mlp, {args.iterations} iterations x {args.rounds} local steps of {BATCH}, "
          f"lr {LR}, seed {args.seed}; {os.cpu_count()} CPUs ({cpu_model()}), "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {versions(python)}", flush=True)
    if args.pairs < 3:
        print(f"note: {args.pairs} pair(s): the rule asks for at least 3 before a ratio is quoted")
    reports, references = [], []
    with tempfile.TemporaryDirectory(prefix="fedavg-vs-pfl-") as tmp:
        for clients, fraction in configs:
            print(f"\n{clients} clients, fraction {fraction:g}:", flush=True)
            folder = Path(tmp) / f"job-{clients}-{fraction:g}"
            facts = prepare_job(folder, data, clients, fraction, args)
            references.append(flop_reference(clients, fraction, facts, args))
            job = Job(data, folder, clients, fraction, python, args)
            start = loadavg()
            candidates = {"meshlearn": MESHLEARN_SETTINGS if args.meshlearn_threads is None
                          else (Setting(1, args.meshlearn_threads),)}
            if python is not None:
                candidates["pfl"] = PFL_SETTINGS if args.pfl_setting is None else (Setting.parse(args.pfl_setting),)
            chosen = {s: c[0] for s, c in candidates.items() if len(c) == 1}
            if len(chosen) < len(candidates):
                print(" calibration:", flush=True)
                chosen.update(job.calibrate({s: c for s, c in candidates.items() if len(c) > 1}))
            chosen = {s: chosen[s] for s in candidates}
            print(" pairs:", flush=True)
            pairs = job.pairs(chosen)
            reports.append(report(clients, fraction, chosen, pairs, (start, loadavg())))
    print("\n" + "\n\n".join(reports))
    print("\nFLOP limit (forward + backward matrix products only):\n" + "\n".join(references))


if __name__ == "__main__":
    main()
