"""Choosing providers by device, RAM and cores (issue 34 items 1, 2, 6), as real processes on loopback:
a bootstrap, providers declaring what they have, requesters asking for what they need."""

from __future__ import annotations

import json
import os
import re
import threading
import time

import pytest
from helpers.netproc import SECRET, Processes, start_network

TASK = ["--data", "digits", "--model", "mlp", "--lr", "0.05", "--batch-size", "16", "--epochs", "1", "--wait", "0"]


def _request(procs: Processes, name: str, bootstrap: str, *args: str, timeout: float = 180):
    proc = procs.start(name, "request", "--bootstrap", bootstrap, "--output", str(procs.folder / name), *args,
                       secret=SECRET)
    proc.wait(timeout=timeout)
    return proc.returncode, procs.log(name)


def _providers(procs: Processes, name: str) -> list[str]:
    return sorted(json.loads((procs.folder / name / "metrics.json").read_text())["providers"])


def _provider(procs: Processes, bootstrap: str, pid: str, *args: str, env: dict | None = None) -> None:
    procs.start(pid, "provider", "--bootstrap", bootstrap, "--id", pid, "--host", "127.0.0.1",
                "--workdir", str(procs.folder / pid), *args, env=env)


@pytest.mark.slow  # test_network_units chooses by device and RAM in the default run
def test_providers_are_chosen_by_device_and_a_shortage_is_said_in_one_line(procs):
    """Two CPU providers and one declaring cuda (the test-only MESHLEARN_TEST_DEVICE): --device gpu
    takes the cuda one only; too few of it trains on those and says so (and a batch larger than a
    shard is said to be cut), or with --device-fallback
    takes a CPU one and names it; a device nobody has fails in one line; no device takes the most
    common one (cpu), not the GPU."""
    bootstrap, _ = start_network(procs, 2)
    _provider(procs, bootstrap, "zgpu", env={"MESHLEARN_TEST_DEVICE": "cuda"})  # last by id: never first by chance
    procs.wait_for("zgpu", r"registered with")
    assert "(cuda)" in procs.log("zgpu")

    code, out = _request(procs, "gpu", bootstrap, *TASK, "--device", "gpu", "--providers", "1")
    assert code == 0, out
    assert _providers(procs, "gpu") == ["zgpu"]

    code, out = _request(procs, "short", bootstrap, *TASK, "--device", "cuda", "--providers", "2",
                         "--batch-size", "1000")
    assert code == 0, out
    assert _providers(procs, "short") == ["zgpu"]
    assert "only 1 free cuda provider(s) of the 2 asked: training on those" in out
    assert re.search(r"note: batch size 1000 is larger than the smallest of 2 shards \(71\d samples\): each "
                     "provider's batches are cut to its shard's size", out), out

    code, out = _request(procs, "fallback", bootstrap, *TASK, "--device", "cuda", "--providers", "2",
                         "--device-fallback")
    assert code == 0, out
    assert _providers(procs, "fallback") == ["p0", "zgpu"]
    assert "only 1 free cuda provider(s) of the 2 asked: also taking p0 (cpu) (--device-fallback)" in out

    code, out = _request(procs, "none", bootstrap, *TASK, "--device", "mps")
    lines = [line for line in out.splitlines() if "error" in line]
    assert code != 0 and len(lines) == 1 and "no free mps provider" in lines[0] and "Traceback" not in out

    code, out = _request(procs, "any", bootstrap, *TASK, "--providers", "1")
    assert code == 0, out
    assert _providers(procs, "any") == ["p0"]  # cpu: two of the three free providers declare it


@pytest.mark.slow  # test_network_units filters by RAM and cores in the default run
def test_ram_and_cores_filter_providers_and_a_task_too_big_for_all_is_refused(procs):
    """A provider declaring 0.1 GB is skipped (the task needs more) with a line saying why, one
    declaring 1 core is skipped by --min-cores; a task needing more than every free provider
    declares is refused in one line before any claim; a provider is warned when it declares less
    than ML's minimum and refused when it declares more than the machine has."""
    bootstrap, _ = start_network(procs, 0)
    _provider(procs, bootstrap, "big")
    _provider(procs, bootstrap, "mid", "--cores", "1")
    _provider(procs, bootstrap, "small", "--ram", "0.1", "--location", "attic")
    for pid in ("big", "mid", "small"):
        procs.wait_for(pid, r"registered with")
    assert "less than the 2 GB minimum for ML: requesters skip this provider" in procs.log("small")
    assert "less than the 2 minimum for ML" in procs.log("mid")

    code, out = _request(procs, "fit", bootstrap, *TASK, "--providers", "3", "--min-cores", "2")
    assert code == 0, out
    assert _providers(procs, "fit") == ["big"]
    assert re.search(r"skipped for too little RAM \(the task needs about 0\.\d+ GB .*\): small \(0\.1 GB\)", out)
    assert "skipped for fewer cores than --min-cores 2: mid (1)" in out

    claims = sum(event.startswith("claimed") for event in _history(procs))
    code, out = _request(procs, "too-big", bootstrap, *TASK, "--location", "attic")
    errors = [line for line in out.splitlines() if "error" in line]
    assert code == 2 and len(errors) == 1, out
    assert "more than any free provider declares (at most 0.1 GB)" in errors[0] and "Traceback" not in out
    assert sum(event.startswith("claimed") for event in _history(procs)) == claims  # refused before any claim

    code, out = _request(procs, "min-ram", bootstrap, *TASK, "--min-ram", "100000")
    assert code != 0 and "skipped for too little RAM (--min-ram 100000)" in out

    for name, args, text in [("over-ram", ["--ram", "100000"], "--ram 100000 is more than this machine has"),
                             ("over-cores", ["--cores", "100000"], "--cores 100000 is more than this machine has")]:
        _provider(procs, bootstrap, name, *args)
        assert procs.procs[name].wait(timeout=60) == 2
        out = procs.log(name).strip()
        assert text in out and out.count("\n") == 0, out


def _history(procs: Processes) -> list[str]:
    """The bootstrap's registry history, "kind subject" per event."""
    import sqlite3

    with sqlite3.connect(procs.folder / "registry.sqlite") as db:
        return [f"{kind} {subject}" for kind, subject in db.execute("SELECT kind, subject FROM history")]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_provider_declaring_one_core_trains_on_one(procs):
    """A provider started with --cores 1 (torch free to use every core otherwise: OMP_NUM_THREADS
    is this machine's count) keeps its training phase's CPU time / wall time at or below 1.2."""
    bootstrap, _ = start_network(procs, 0)
    _provider(procs, bootstrap, "one", "--cores", "1", env={"OMP_NUM_THREADS": str(os.cpu_count())})
    procs.wait_for("one", r"registered with")
    pid = procs.procs["one"].pid
    samples: list[tuple[float, float]] = []
    done = threading.Event()
    request = procs.start("req", "request", "--bootstrap", bootstrap, "--output", str(procs.folder / "req"),
                          "--data", "digits", "--model", "simplecnn", "--batch-size", "128", "--epochs", "8",
                          "--lr", "0.05", "--wait", "0", "--providers", "1")

    def sample():
        while not done.is_set():
            states = re.findall(r"one: (\w+)", procs.log("req"))
            if states and states[-1] == "training":
                samples.append((time.monotonic(), _cpu_seconds(pid)))
            time.sleep(0.1)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        assert request.wait(timeout=240) == 0, procs.log("req")
    finally:
        done.set()
        sampler.join(5)
    assert len(samples) >= 10, (samples, procs.log("req"))
    (t0, c0), (t1, c1) = samples[0], samples[-1]
    ratio = (c1 - c0) / (t1 - t0)
    print(f"training: {c1 - c0:.2f} s of CPU in {t1 - t0:.2f} s of wall time: {ratio:.2f}")
    assert ratio <= 1.2, ratio
