"""One FedAvg job, side by side: meshlearn's batched engine against Apple's pfl-research (pfl 0.6.0),
measured by the peer-benchmark rule of `benchmarks/README.md`, and how each scales with the population.

A job is a data set, a population of clients and a per-round cohort (a share of them or a count):
meshlearn's `mlp`; local plain SGD, lr 0.05, batch 32, 10 local steps per round (`--rounds`); 20
central iterations (`--iterations`); FedAvg weighted by training samples, server learning rate 1
(plain averaging); seed 1. The jobs (`--job NAME`, repeatable; default the first two):

- `fmnist-100-all`: Fashion-MNIST split IID over 100 clients, all of them every round;
- `fmnist-1000-10pct`: the same over 1,000 clients, 10% of them a round;
- `scale-synthetic-1000`, `-10000`, `-100000`: the synthetic federated data set of the FedProx
  paper / LEAF, `synthetic:1,1`, one user per client (meshlearn: `--partition writers`), a cohort of
  100 a round (`--fedavg-cohort 100`);
- `scale-fmnist-1000`, `-10000`: Fashion-MNIST IID, a cohort of 100 a round.

The same job in both. The driver draws, with meshlearn's own code, the client split, each
iteration's cohort (FedAvg's seeded draw of a count, `participants`; a share becomes a count as
meshlearn's FedAvg settings make it), the initial weights (`torch.manual_seed(seed)`, then
`build_model`) and every drawn client's batches: each client takes the next batches of its own
endless stream, reshuffled every epoch (`ShardLoaders` over its samples with `loader_seed(seed,
client)`, as meshlearn's engine draws them; a client not drawn draws nothing and gets no stream at
all, so a population of 100,000 costs the driver its drawn clients only). The pfl job
(`pfl_fedavg_job.py` beside this file; pfl, torch and numpy only) trains on exactly those batches, so
the two compute the same steps on the same samples, and their final test accuracies agree to float
rounding (the difference is printed). pfl's own `Dataset` would restart a client's shard each time
it is drawn (the same first 320 samples every round); meshlearn's stream is kept, and pfl made to
follow it. Each system reads its data itself: Fashion-MNIST from the IDX files; the synthetic users
each generated from the seed when drawn, by meshlearn's `meshlearn.data.synthetic` and by the job's
own copy of the formula, which the driver checks agree (digests of the size table, a few users'
samples and the test set) before timing anything.

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
   1-minute load average at the start and end; for the scaling jobs also CPU seconds per round
   (CPU seconds / iterations), and at the end a scaling table per data set: each system's peak PSS
   and CPU seconds per round at each population (medians of the pairs) and their spread (max / min),
   against the aim: meshlearn's peak memory within 10% and its CPU per round within 20% across the
   populations, and at 100,000 clients meshlearn's CPU per round at most pfl's.

pfl is installed in its own virtual environment (`--venv`, default `benchmarks/.venv-pfl`, made if
missing: pfl 0.6.0 and, if the venv has none, the driver's own torch version); without it the pfl
side is skipped (`--no-pfl` skips it on purpose, `--no-meshlearn` the meshlearn side). Without the
data folder the Fashion-MNIST jobs are skipped (exit 0 if none is left).

    python benchmarks/fedavg_vs_pfl.py [--job NAME ...] [--data ../shared/datasets/fashion-mnist]
        [--clients C --fraction F] [--pairs 3] [--iterations 20] [--rounds 10] [--seed 1]
        [--choose-by cpu|wall] [--meshlearn-threads 1|2] [--pfl-setting 1|2|2x1]
        [--venv benchmarks/.venv-pfl] [--no-pfl | --no-meshlearn] [--keep DIR]
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SRC = REPO / "src"
JOB = HERE / "pfl_fedavg_job.py"
PFL_VERSION = "0.6.0"
LR, BATCH, SERVER_LR = 0.05, 32, 1.0
FMNIST = "fashion-mnist"
SCALE_COHORT = 100  # the scaling jobs' clients a round, whatever the population
PSS_AIM, CPU_AIM = 1.10, 1.20  # scaling: meshlearn's peak PSS and CPU per round, max / min over the populations
FLOPS_LIMIT = 100e9  # the reference machine: 100 GFLOP/s
POLL = 0.2  # seconds between PSS samples
STOP_AFTER = 3  # calibration: a candidate run is stopped after 3x (+ 10 s) its system's best wall time so far
AGREE = 0.005  # accuracies further apart than this are flagged: the two did not run the same job

sys.path.insert(0, str(SRC))

if TYPE_CHECKING:
    import numpy as np


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


@dataclass(frozen=True)
class JobSpec:
    """One configuration: the data set (``fashion-mnist``, split IID, or ``synthetic:ALPHA,BETA``, a
    user per client), the population of ``clients``, and each round's cohort: ``cohort`` clients, or
    (``cohort`` 0) a share ``fraction`` of them."""

    name: str
    dataset: str
    clients: int
    fraction: float = 1.0
    cohort: int = 0

    @property
    def synthetic(self) -> tuple[float, float] | None:
        """ALPHA and BETA of a synthetic job, else None."""
        if not self.dataset.startswith("synthetic:"):
            return None
        alpha, beta = self.dataset.split(":", 1)[1].split(",")
        return float(alpha), float(beta)

    @property
    def scaling(self) -> bool:
        """Whether the job is one of a population series (its CPU per round goes in the scaling table)."""
        return self.name.startswith("scale-")

    def count(self) -> int:
        """The clients drawn a round, as meshlearn's FedAvg settings make it of a count or a share."""
        from meshlearn.definitions.settings import FedAvgSettings

        return FedAvgSettings(fraction=self.fraction, cohort=self.cohort).drawn(self.clients)

    def describe(self) -> str:
        """``synthetic:1,1, 1,000 clients, cohort 100 a round``."""
        drawn = f"cohort {self.cohort} a round" if self.cohort else f"fraction {self.fraction:g}"
        return f"{self.name}: {self.dataset}, {self.clients:,} clients, {drawn}"

    def meshlearn_args(self, data: Path) -> list[str]:
        """The job's data, split and cohort as `meshlearn simulate` options."""
        drawn = ["--fedavg-cohort", str(self.cohort)] if self.cohort else ["--fedavg-fraction", str(self.fraction)]
        if self.synthetic:
            return ["--dataset", self.dataset, "--partition", "writers", *drawn]
        return ["--dataset", f"{FMNIST}:{data}", "--partition", "iid", *drawn]


JOBS = {job.name: job for job in (
    JobSpec("fmnist-100-all", FMNIST, 100),
    JobSpec("fmnist-1000-10pct", FMNIST, 1000, fraction=0.1),
    *(JobSpec(f"scale-synthetic-{n}", "synthetic:1,1", n, cohort=SCALE_COHORT) for n in (1000, 10_000, 100_000)),
    *(JobSpec(f"scale-fmnist-{n}", FMNIST, n, cohort=SCALE_COHORT) for n in (1000, 10_000)),
)}
DEFAULT_JOBS = ("fmnist-100-all", "fmnist-1000-10pct")
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


@dataclass(frozen=True)
class Clients:
    """A job's population as the driver needs it, with no state for a client until it is asked for:
    ``shard(k)``, the samples client k's stream runs over (Fashion-MNIST: its training-set indices;
    synthetic: 0 .. its training samples - 1, indices into its own), whose count FedAvg weighs it
    by; the model's input shape; what ``job.json`` says of the data (``fields``); and for a synthetic
    job meshlearn's generator (``population``)."""

    shard: Callable[[int], np.ndarray]
    input_shape: tuple[int, ...]
    fields: dict
    population: object = None


def load_clients(job: JobSpec, data: Path, seed: int) -> Clients:
    """``job``'s clients from meshlearn's own code: Fashion-MNIST split IID by ``partition_dataset``,
    or the synthetic population of ``meshlearn.data.synthetic`` (only its size table is made)."""
    import numpy as np

    if job.synthetic:
        from meshlearn.data.synthetic import SHAPE, SyntheticPopulation

        alpha, beta = job.synthetic
        population = SyntheticPopulation(alpha, beta, job.clients, seed)
        return Clients(lambda k: np.arange(population.sizes[k], dtype=np.int64), SHAPE,
                       {"dataset": "synthetic", "alpha": alpha, "beta": beta, "users": job.clients,
                        "mean": 0.0, "std": 1.0}, population)
    from meshlearn.data import load_dataset, partition_dataset

    dataset = load_dataset(f"{FMNIST}:{data}")
    parts = partition_dataset(dataset, job.clients, "iid", seed)
    return Clients(lambda k: parts[k], dataset.input_shape,
                   {"dataset": FMNIST, "data": str(data), "mean": float(dataset.mean[0]), "std": float(dataset.std[0])})


def draw_batches(clients: Clients, cohorts: np.ndarray, rounds: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every drawn client's batches in each iteration, as meshlearn's engine draws them: one
    ``ShardLoaders`` stream (seeded ``loader_seed(seed, client)``) per client drawn at least once,
    none for the others; each iteration the cohort's streams step ``rounds`` times. Returns each
    drawn client's training samples (``weights``, the cohorts' shape), its batches' sizes
    ([iterations, cohort, rounds]) and their samples laid end to end (``picks``)."""
    import numpy as np

    from meshlearn.data import ShardLoaders, loader_seed

    drawn = np.unique(cohorts)  # every client drawn in some iteration, ascending
    loaders = ShardLoaders([clients.shard(int(k)) for k in drawn], BATCH, [loader_seed(seed, int(k)) for k in drawn])
    rows = np.searchsorted(drawn, cohorts)  # each cohort member's stream (a cohort is sorted: so are its rows)
    sizes = np.zeros((*cohorts.shape, rounds), dtype=np.int64)
    chunks: list[list[list[np.ndarray]]] = []
    for t, row in enumerate(rows):
        batches: list[list[np.ndarray]] = [[] for _ in row]
        for step in range(rounds):
            for members, picks in loaders.next(row):
                for column, pick in zip(np.searchsorted(row, members).tolist(), picks):
                    batches[column].append(pick)
                    sizes[t, column, step] = len(pick)
        chunks.append(batches)
    picks = np.concatenate([pick for batches in chunks for client in batches for pick in client]).astype(np.int32)
    return loaders.sizes[rows], sizes, picks


def prepare_job(folder: Path, job: JobSpec, clients: Clients, args) -> dict:
    """Write the pfl job's inputs into ``folder`` from meshlearn's own code: the cohorts FedAvg draws,
    the initial weights, the hyperparameters, and every drawn client's batches in each iteration
    (``draw_batches``): files proportional to the drawn clients, not the population. Returns the
    facts the report needs (cohort size, FLOPs per local step)."""
    import numpy as np
    import torch

    from meshlearn.definitions.fedavg import participants
    from meshlearn.models import build_model
    from meshlearn.models.cost import step_flops

    count = job.count()
    cohorts = np.array([participants(args.seed, t, job.clients, count) for t in range(args.iterations)], dtype=np.int64)
    weights, sizes, picks = draw_batches(clients, cohorts, args.rounds, args.seed)
    torch.manual_seed(args.seed)
    model = build_model("mlp", clients.input_shape, 10)
    folder.mkdir(parents=True)
    np.savez(folder / "split.npz", cohorts=cohorts, weights=weights, sizes=sizes, picks=picks)
    torch.save(model.state_dict(), folder / "init.pt")
    spec = {"seed": args.seed, "clients": job.clients, "cohort": count, "iterations": args.iterations,
            "steps": args.rounds, "batch_size": BATCH, "lr": LR, "server_lr": SERVER_LR, **clients.fields}
    (folder / "job.json").write_text(json.dumps(spec))
    return {"cohort": count, "step_flops": step_flops(model, torch.zeros(clients.input_shape), BATCH)}


def job_module():
    """``pfl_fedavg_job.py`` as a module (its top level imports the standard library only): for its
    ``digest``, so that both sides hash alike."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pfl_fedavg_job", JOB)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check_generators(python: Path, folder: Path, clients: Clients) -> str:
    """Before timing a synthetic job: the pfl job's copy of the generator against meshlearn's, on the
    size table, the training samples of a few users (the first two, the last, and the first and
    last drawn) and the test set; SystemExit in one line where any differs, else the line to say."""
    import numpy as np

    cohorts = np.load(folder / "split.npz")["cohorts"]
    population = clients.population
    users = sorted({0, min(1, population.users - 1), population.users - 1, int(cohorts[0, 0]), int(cohorts[-1, -1])})
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([str(python), str(JOB), str(folder), "--check-users", ",".join(map(str, users))],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the pfl job's --check-users failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    digest = job_module().digest
    ours = {"sizes": digest(population.sizes),
            "users": {str(k): digest(*(t.numpy() for t in population.samples(k))) for k in users},
            "test": digest(*(t.numpy() for t in population.test_set()))}
    wrong = [name for name in ("sizes", "test") if ours[name] != theirs[name]]
    wrong += [f"user {k}" for k in users if ours["users"][str(k)] != theirs["users"].get(str(k))]
    if wrong:
        raise SystemExit(f"{population.name}: pfl_fedavg_job.py's generator and meshlearn.data.synthetic disagree on "
                         f"{', '.join(wrong)}: make them the same formula (synthetic_user) before comparing")
    return (f"synthetic data: pfl's generator and meshlearn's agree bit for bit (size table of {population.users:,} "
            f"users, training samples of users {', '.join(map(str, users))}, the test set)")


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
    ``stopped``: its CPU seconds are then a lower bound. A run that fails stops the benchmark (SystemExit
    with the tail of its stderr)."""
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
        raise SystemExit(f"{' '.join(command[:4])} ... failed ({code}):\n{log.with_suffix('.err').read_text()[-3000:]}")
    return result


def run_meshlearn(data: Path, job: JobSpec, setting: Setting, args, output: Path, limit: float | None = None) -> dict:
    """One `meshlearn simulate` of the job (batched engine); its measures and final test accuracy."""
    command = [sys.executable, "-m", "meshlearn", "simulate", "--quiet", "--engine", "batched",
               "--batched-workers", str(setting.threads), "--nodes", str(job.clients), "--algorithm", "fedavg",
               *job.meshlearn_args(data), "--model", "mlp",
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

    def __init__(self, data: Path, folder: Path, job: JobSpec, python: Path | None, args):
        self.data, self.folder, self.job, self.python, self.args = data, folder, job, python, args
        self.count = 0

    def run(self, system: str, setting: Setting, limit: float | None = None) -> dict:
        """One run of ``system`` on ``setting`` (stopped after ``limit`` wall seconds), said as it ends."""
        self.count += 1
        output = self.folder / f"{system}-{self.count}"
        if system == "meshlearn":
            result = run_meshlearn(self.data, self.job, setting, self.args, output, limit)
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


def medians(pairs: list[dict], iterations: int) -> dict[str, dict[str, float]]:
    """Per system, the median over its runs of peak PSS (MB) and of CPU seconds per round."""
    systems = [s for s in ("meshlearn", "pfl") if s in pairs[0]]
    return {s: {"pss": statistics.median(pair[s]["pss"] for pair in pairs),
                "cpu_round": statistics.median(pair[s]["cpu"] for pair in pairs) / iterations} for s in systems}


def report(job: JobSpec, chosen: dict[str, Setting], pairs: list[dict], loads: tuple[float, float],
           figures: dict[str, dict[str, float]]) -> str:
    """One configuration's pairs as Markdown: the table, the ratios, the accuracies (a scaling job's
    CPU seconds per round too)."""
    lines = [f"#### {job.describe()} (load {loads[0]:.2f} at the start, {loads[1]:.2f} at the end)",
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
        system = systems[0]
        lines += [f"| run | {system} CPU s | wall s | peak PSS MB | accuracy | load at start |", "|---|---|---|---|---|---|"]
        for k, pair in enumerate(pairs, 1):
            r = pair[system]
            lines.append(f"| {k} | {r['cpu']:.1f} | {r['wall']:.1f} | {r['pss']:.0f} | {r['accuracy']:.4f} | {r['load']:.2f} |")
    if job.scaling:
        lines += ["", "CPU seconds per round (median of the runs / iterations): "
                  + "; ".join(f"{s} {figures[s]['cpu_round']:.3f}" for s in systems)]
    return "\n".join(lines)


def verdict(met: bool) -> str:
    """``met`` or ``**not met**``."""
    return "met" if met else "**not met**"


def scaling_report(results: list[tuple[JobSpec, dict[str, dict[str, float]]]]) -> str:
    """The scaling jobs' figures per data set: each system's peak PSS and CPU seconds per round at
    each population, their spread (max / min), and the aims for meshlearn (peak PSS within
    ``PSS_AIM``, CPU per round within ``CPU_AIM``, and at the largest population at most pfl's CPU)."""
    series: dict[str, list[tuple[JobSpec, dict]]] = {}
    for job, figures in results:
        if job.scaling:
            series.setdefault(job.dataset, []).append((job, figures))
    lines = ["### Scaling (medians of each job's runs; spread = max / min over the populations)"]
    for dataset, rows in series.items():
        rows.sort(key=lambda row: row[0].clients)
        systems = [s for s in ("meshlearn", "pfl") if all(s in figures for _, figures in rows)]
        lines += ["", f"#### {dataset}, a cohort of {rows[0][0].count()} a round", "",
                  "| system | " + " | ".join(f"{job.clients:,} clients" for job, _ in rows)
                  + " | peak PSS spread | CPU per round spread |", "|---" * (len(rows) + 3) + "|"]
        spreads = {}
        for system in systems:
            pss = [figures[system]["pss"] for _, figures in rows]
            cpu = [figures[system]["cpu_round"] for _, figures in rows]
            spreads[system] = (max(pss) / min(pss), max(cpu) / min(cpu))
            lines.append(f"| {system} | " + " | ".join(f"{m:.0f} MB, {c:.3f} CPU s/round" for m, c in zip(pss, cpu))
                         + f" | {spreads[system][0]:.2f} | {spreads[system][1]:.2f} |")
        aims = []
        if "meshlearn" in spreads and len(rows) > 1:
            memory, cpu = spreads["meshlearn"]
            aims += [f"- meshlearn's peak PSS within {PSS_AIM - 1:.0%} across the populations: {memory:.2f} ({verdict(memory <= PSS_AIM)})",
                     f"- meshlearn's CPU per round within {CPU_AIM - 1:.0%}: {cpu:.2f} ({verdict(cpu <= CPU_AIM)})"]
        largest, figures = rows[-1]
        if {"meshlearn", "pfl"} <= set(systems):
            ratio = figures["meshlearn"]["cpu_round"] / figures["pfl"]["cpu_round"]
            aims.append(f"- at {largest.clients:,} clients meshlearn's CPU per round at most pfl's: meshlearn / pfl "
                        f"{ratio:.2f} ({verdict(ratio <= 1)})")
        lines += ["", *aims] if aims else []
    return "\n".join(lines)


def flop_reference(job: JobSpec, facts: dict, args) -> str:
    """The FLOP limit: node-steps x FLOPs per step at 100 GFLOP/s."""
    node_steps = facts["cohort"] * args.rounds * args.iterations
    seconds = node_steps * facts["step_flops"] / FLOPS_LIMIT
    return (f"- {job.describe()}: {node_steps:,} node-steps x {facts['step_flops']:,} FLOPs "
            f"= {seconds:.3g} s at 100 GFLOP/s")


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", action="append", choices=list(JOBS), dest="jobs",
                        help=f"a named job (repeatable; default: {', '.join(DEFAULT_JOBS)})")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "datasets" / "fashion-mnist",
                        help="folder of Fashion-MNIST's IDX files (default: ../shared/datasets/fashion-mnist)")
    parser.add_argument("--clients", type=int, help="one Fashion-MNIST job instead: this many clients (with --fraction)")
    parser.add_argument("--fraction", type=float, help="one Fashion-MNIST job instead: the share drawn per iteration")
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
    parser.add_argument("--keep", type=Path, metavar="DIR",
                        help="write each job's folder (the pfl job's inputs, the runs' outputs and logs) in DIR and keep it")
    side = parser.add_mutually_exclusive_group()
    side.add_argument("--no-pfl", action="store_true", help="run the meshlearn side only")
    side.add_argument("--no-meshlearn", action="store_true", help="run the pfl side only (on the inputs meshlearn's code draws)")
    args = parser.parse_args()
    if (args.clients is None) != (args.fraction is None):
        parser.error("--clients and --fraction go together")
    if args.clients is not None and args.jobs:
        parser.error("give --job NAME or --clients C --fraction F, not both")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.keep is not None:
        args.keep = args.keep.resolve()
    args.jobs = ([JobSpec(f"fmnist-{args.clients}-{args.fraction:g}", FMNIST, args.clients, fraction=args.fraction)]
                 if args.clients is not None else [JOBS[name] for name in dict.fromkeys(args.jobs or DEFAULT_JOBS)])
    taken = [job.name for job in args.jobs if args.keep is not None and (args.keep / job.name).exists()]
    if taken:
        parser.error(f"--keep {args.keep} already holds {', '.join(taken)}: give it a new or empty folder")
    return args


def has_idx(data: Path) -> bool:
    """Whether ``data`` holds Fashion-MNIST's training images (gzipped or not)."""
    return (data / "train-images-idx3-ubyte.gz").is_file() or (data / "train-images-idx3-ubyte").is_file()


def settings_of(job: Job, python: Path | None, args) -> dict[str, Setting]:
    """Each system's setting for ``job``: given on the command line, else calibrated."""
    candidates = {}
    if not args.no_meshlearn:
        candidates["meshlearn"] = MESHLEARN_SETTINGS if args.meshlearn_threads is None else (Setting(1, args.meshlearn_threads),)
    if python is not None:
        candidates["pfl"] = PFL_SETTINGS if args.pfl_setting is None else (Setting.parse(args.pfl_setting),)
    chosen = {s: c[0] for s, c in candidates.items() if len(c) == 1}
    if len(chosen) < len(candidates):
        print(" calibration:", flush=True)
        chosen.update(job.calibrate({s: c for s, c in candidates.items() if len(c) > 1}))
    return {s: chosen[s] for s in candidates}


def main() -> None:
    args = parse()
    data = args.data.resolve()
    jobs = args.jobs
    if not has_idx(data) and any(not job.synthetic for job in jobs):
        print(f"skipped: no Fashion-MNIST IDX files in {data}: "
              + ", ".join(job.name for job in jobs if not job.synthetic))
        jobs = [job for job in jobs if job.synthetic]
        if not jobs:
            return
    python = None if args.no_pfl else ensure_pfl(args.venv)
    if args.no_meshlearn and python is None:
        print("nothing to run: --no-meshlearn and no pfl")
        return
    print(f"FedAvg, mlp, {args.iterations} iterations x {args.rounds} local steps of {BATCH}, "
          f"lr {LR}, seed {args.seed}; {os.cpu_count()} CPUs ({cpu_model()}), "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {versions(python)}", flush=True)
    if args.pairs < 3:
        print(f"note: {args.pairs} pair(s): the rule asks for at least 3 before a ratio is quoted")
    reports, references, results = [], [], []
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="fedavg-vs-pfl-"))
        for spec in jobs:
            print(f"\n{spec.describe()}:", flush=True)
            folder = Path(tmp) / spec.name
            clients = load_clients(spec, data, args.seed)
            facts = prepare_job(folder, spec, clients, args)
            if clients.population is not None and python is not None:
                print(" " + check_generators(python, folder, clients), flush=True)
            references.append(flop_reference(spec, facts, args))
            job = Job(data, folder, spec, python, args)
            start = loadavg()
            chosen = settings_of(job, python, args)
            print(" pairs:", flush=True)
            pairs = job.pairs(chosen)
            figures = medians(pairs, args.iterations)
            reports.append(report(spec, chosen, pairs, (start, loadavg()), figures))
            results.append((spec, figures))
    print("\n" + "\n\n".join(reports))
    print("\nFLOP limit (forward + backward matrix products only):\n" + "\n".join(references))
    if any(job.scaling for job, _ in results):
        print("\n" + scaling_report(results))


if __name__ == "__main__":
    main()
