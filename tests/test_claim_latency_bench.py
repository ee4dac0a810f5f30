"""The claim-latency benchmark (benchmarks/claim_latency.py) at a tiny size, as a real run on
loopback: one pair of runs (one bootstrap on SQLite, then three sharing an etcd cluster), 20 claims
each; its JSON lines carry every figure benchmarks/RESULTS.md quotes. Skipped where etcd is not
installed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from helpers.etcdlab import needs_etcd

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "claim_latency.py"
RUN_LIMIT_S = 300  # a safety net on a loaded machine (about 20 s on an idle one), never the point
STOP_GRACE_S = 30  # seconds the benchmark has to stop its processes after SIGTERM
LATENCIES = ("p50_ms", "p99_ms", "contended_p50_ms", "contended_p99_ms")


def _run(*args: str) -> subprocess.CompletedProcess:
    """The benchmark run with ``args``; stopped (SIGTERM, then SIGKILL) if it outlasts RUN_LIMIT_S.
    Its bootstraps and etcd members die with it whatever happens."""
    proc = subprocess.Popen([sys.executable, str(BENCHMARK), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, err = proc.communicate(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        raise AssertionError(f"the benchmark ran past {RUN_LIMIT_S} s:\n{out}\n{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@needs_etcd
def test_a_tiny_run_reports_every_figure_per_setup():
    done = _run("--pairs", "1", "--claims", "20", "--providers", "4")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    runs, summary = lines[:-1], lines[-1]["summary"]
    assert [row["setup"] for row in runs] == ["a", "b"]
    for row in runs:
        assert row["providers"] == 4 and row["claims"] == 20
        assert all(0 < row[name] for name in LATENCIES), row
        assert row["p50_ms"] <= row["p99_ms"] and row["contended_p50_ms"] <= row["contended_p99_ms"], row
        assert row["other_claims"] >= 2, row  # both other clients claimed while the timed ones ran
    cluster = runs[1]
    assert cluster["revoke_reach_s"] >= 0 and cluster["revoke_command_s"] > 0 and cluster["revoke_passes"] >= 1, cluster
    assert cluster["failover_s"] > 0, cluster
    assert set(summary) == {"a", "b"}
    assert set(summary["a"]) == set(LATENCIES)
    assert set(summary["b"]) == {*LATENCIES, "revoke_reach_s", "failover_s"}
    assert summary["b"]["failover_s"] == {"median": cluster["failover_s"], "min": cluster["failover_s"],
                                          "max": cluster["failover_s"]}
    assert "| b: 3 bootstraps, etcd x3 (TLS) |" in done.stdout  # the table RESULTS.md takes


def test_more_providers_than_one_address_may_register_is_refused_in_one_line():
    done = _run("--providers", "65")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].endswith(
        "--providers 65: give 3 to 64 (every claimer holds one at a time; a bootstrap takes 64 per address)")
