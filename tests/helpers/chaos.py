"""Chaos trials on the compute-sharing network: a bootstrap and providers as real processes, one
of them SIGKILLed in the middle of a task's training, then the checks a user of the network cares
about. Used by the CI chaos test (``tests/test_chaos.py``) and the randomized benchmark
(``benchmarks/chaos.py``).

One trial: start a bootstrap and ``providers`` providers; request a ``digits`` task; once training
is ``at`` of the way through (a test's trial: while every provider holds at training step ``hold``,
``helpers/hold.py``), SIGKILL the victim (the leader ``p0``, a follower, or the bootstrap, which is
then restarted on its state file); then check

- delivered: the requester exits 0 with a model and metrics;
- busy: which providers the bootstrap still shows busy once the requester has exited;
- second: a second task, requested right after, runs to the end on whoever is left;
- left: which processes are still running 10 s after SIGTERM at teardown (then SIGKILLed).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.hold import MODELS, Hold
from helpers.netproc import SECRET, Processes, start_network

from meshlearn.errors import NetworkError
from meshlearn.network.channel.rpc import call

KILLS = ("none", "follower", "leader", "bootstrap")
STOP_WAIT = 10.0  # seconds a process gets to stop on SIGTERM
TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--aggregate-every", "3",
        "--peer-timeout", "3"]
HELD = ["--model", "held-mlp", "--models-module", MODELS]  # TASK's mlp, held at a step (helpers/hold.py)


@dataclass
class Trial:
    """What one trial does: the task's algorithm and seed, which process dies, and when."""

    algorithm: str
    kill: str = "none"
    seed: int = 90
    at: float = 0.3  # share of the training iterations done when the victim is killed (without ``hold``)
    hold: int = 0  # a test's trial: the training step every provider holds at while the victim is killed (0:
    # none, the victim is killed once the requester says ``at`` is done: a benchmark's point, as it comes)
    epochs: int = 30
    providers: int = 4
    victim: str = ""  # which follower, for kill == "follower" (default: the last provider)


@dataclass
class Outcome:
    """What one trial found."""

    trial: Trial
    delivered: bool = False
    accuracy: float | None = None
    lost: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)  # after a bootstrap restart: the providers it lists
    busy: list[str] = field(default_factory=list)
    second: bool = False
    left: list[str] = field(default_factory=list)
    seconds: float = 0.0
    problem: str = ""


def run_trial(folder: Path, trial: Trial, timeout: float = 300.0) -> Outcome:
    """Run one trial in ``folder`` (logs stay there); always leaves no process behind."""
    outcome, started = Outcome(trial), time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    procs = Processes(folder)
    try:
        hold = Hold(folder, trial.hold) if trial.hold else None
        held = ("--models-module", MODELS) if hold else ()
        bootstrap, ids = start_network(procs, trial.providers, provider_args=held,
                                       provider_env=hold.env if hold else None)
        request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(folder / "req"), *TASK,
                              *(HELD if hold else ()), "--algorithm", trial.algorithm, "--epochs", str(trial.epochs),
                              "--providers", str(trial.providers), "--seed", str(trial.seed))
        if trial.kill != "none":
            kill_mid_training(procs, trial, ids, bootstrap, hold)
            if trial.kill == "bootstrap":
                outcome.restored = _listed(bootstrap, lambda p: True)
        elif hold:
            hold.release()
        request.wait(timeout=timeout)
        metrics_file = folder / "req" / "metrics.json"
        outcome.delivered = request.returncode == 0 and metrics_file.is_file()
        if outcome.delivered:
            metrics = json.loads(metrics_file.read_text())
            outcome.accuracy, outcome.lost = metrics["accuracy"], metrics["lost"]
        else:
            outcome.problem = f"request exited {request.returncode}: {procs.log('req')[-2000:]}"
        outcome.busy = _listed(bootstrap, lambda p: p["status"] == "busy")
        second = procs.start("req2", "request", "--bootstrap", bootstrap, "--output", str(folder / "req2"), *TASK,
                             "--algorithm", trial.algorithm, "--epochs", "2", "--providers", str(trial.providers))
        outcome.second = second.wait(timeout=timeout) == 0
        if not outcome.second and not outcome.problem:
            outcome.problem = f"second task failed: {procs.log('req2')[-2000:]}"
        outcome.left = _stop_all(procs)
    finally:
        procs.stop_all()
        outcome.seconds = time.monotonic() - started
    return outcome


def kill_mid_training(procs: Processes, trial: Trial, ids: list[str], bootstrap: str,
                      hold: Hold | None = None) -> None:
    """SIGKILL the trial's victim in the middle of the task's training: while every provider waits at
    ``hold``'s step (a test's trial: the task cannot end first), released once the victim is dead (and a
    killed bootstrap back); without one, once the requester says ``trial.at`` of it is done."""
    victim = {"leader": ids[0], "follower": trial.victim or ids[-1], "bootstrap": "bootstrap"}[trial.kill]
    if hold is not None:
        hold.wait_held(procs, ids)
    else:
        watched = ids[1] if victim == ids[0] else ids[0]  # a provider that lives on
        found = procs.wait_for("req", rf"{watched}: training \d+/(\d+)", timeout=120)
        target = max(1, int(trial.at * int(found.group(1))))
        procs.wait_for("req", rf"{watched}: (?:training|finishing) (\d+)/", timeout=120,
                       accept=lambda match: int(match.group(1)) >= target)
    procs.kill(victim)
    if trial.kill == "bootstrap":
        port = bootstrap.split("@")[0].rsplit(":", 1)[1]  # the same port and state folder, so the same key
        procs.start("bootstrap2", "bootstrap", "--port", port, "--state", str(procs.folder / "registry.sqlite"),
                    "--relay-port", "0")
        procs.wait_for("bootstrap2", "bootstrap on")
    if hold is not None:
        hold.release()


def _listed(bootstrap: str, keep) -> list[str]:
    """The providers the bootstrap lists that ``keep`` keeps (it may need a moment after a restart)."""
    for _ in range(50):
        try:
            listed = call(bootstrap, "discover", {"count": 100, "free_only": False}, SECRET.encode(), timeout=5)
            return sorted(p["id"] for p in listed.body["providers"] if keep(p))
        except NetworkError:
            time.sleep(0.2)
    return ["<no bootstrap>"]


def _stop_all(procs: Processes) -> list[str]:
    """SIGTERM every process still running; the names of those still running after STOP_WAIT."""
    running = {name: proc for name, proc in procs.procs.items() if proc.poll() is None}
    for proc in running.values():
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT
    for proc in running.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - still running: reported below
            pass
    return sorted(name for name, proc in running.items() if proc.poll() is None)


def summary(outcomes: list[Outcome]) -> dict:
    """Counts over trials."""
    return {"trials": len(outcomes), "delivered": sum(o.delivered for o in outcomes),
            "second_task_ran": sum(o.second for o in outcomes),
            "providers_shown_busy": sum(len(o.busy) for o in outcomes),
            "processes_left": sum(len(o.left) for o in outcomes)}

