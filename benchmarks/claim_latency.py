"""Claim latency with one bootstrap (its SQLite registry) and with three bootstraps sharing one
registry in a cluster of three etcd members (TLS, client certificates); and, for the cluster, how
long claims stop after the etcd leader's machine dies, and how long a revocation takes to reach
every bootstrap. Real processes on loopback: `meshlearn bootstrap` and Debian's etcd.

Each run starts its setup afresh, registers ``--providers`` providers over the protocol (a
``register`` request per provider id, each with its own key pair; the bootstraps run with
``--dial-back false``, so no provider server has to answer), then times ``--claims`` sequential
claim+release pairs (the claim's round trip only: a new connection, its handshake and admission,
the registry's transaction), then as many again while 2 other clients, each with its own key,
claim and release without pause. Claims go to the bootstraps in turn (the cluster's three share
one registry). A cluster run then measures, once each: the seconds from ``meshlearn revoke
--registry ...`` returning until every bootstrap refuses the revoked key, and the seconds from
SIGKILL to the etcd leader's machine (its member and its bootstrap) until a claim through the two
others succeeds (asked as a requester asks its bootstraps: the next where one does not serve).
Setups alternate a, b, a, b, ... (``--pairs`` pairs); one JSON line per run, then a summary (per
setup, the median of the runs' p50s and p99s and their range) and the same as a Markdown table.

    python benchmarks/claim_latency.py --pairs 3 --claims 200 --providers 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from meshlearn.errors import KeyRefused
from meshlearn.network.bootstrap.etcd import EtcdClient, EtcdTls
from meshlearn.network.bootstrap.etcdcluster import (
    EtcdMember,
    MemberSpec,
    client_urls,
    dying_with_this_process,
    etcd_binary,
    make_cluster_certs,
    member_tls,
    missing_etcd_message,
)
from meshlearn.network.bootstrap.registrants import MAX_PROVIDERS_PER_ADDRESS
from meshlearn.network.channel.identity import KeyPair
from meshlearn.network.protocol import rpcs
from meshlearn.network.protocol.bootstrapapi import Claim, Discover, Register, Release
from meshlearn.network.protocol.bootstraps import Bootstraps
from meshlearn.network.protocol.message import Empty
from meshlearn.network.protocol.serving import ask

SECRET = "claim-latency-benchmark"  # the network secret of every process a run starts
MEMBERS = 3  # etcd members, and bootstraps, of setup b
CONTENDERS = 2  # other clients claiming while the contended claims are timed
READY_S = 60.0  # seconds a bootstrap or an etcd member may take to start on a busy machine
ASK_S = 10.0  # seconds one request may take while latency is measured (a slower one fails the run)
GIVE_UP_S = 60.0  # seconds after a kill or a revocation before the run gives up waiting
POLL_S = 0.005  # seconds between two looks at whether every bootstrap refuses a revoked key
PROVIDER_TTL = 3600.0  # the bootstraps' --ttl: these providers send no heartbeats, and must outlast a run
BOOTSTRAP_SAYS = re.compile(r"other machines give --bootstrap (\S+)")  # a bootstrap's line once it serves
FIGURES = {"p50_ms": "claim p50, ms", "p99_ms": "claim p99, ms", "contended_p50_ms": "contended p50, ms",
           "contended_p99_ms": "contended p99, ms", "revoke_reach_s": "revoke to all refusing, s",
           "failover_s": "leader's machine killed to a claim, s"}  # the table's columns
SETUPS = {"a": "one bootstrap, SQLite", "b": f"{MEMBERS} bootstraps, etcd x{MEMBERS} (TLS)"}


def free_port(taken: set[int]) -> int:
    """A free loopback port, not one of ``taken`` (which it joins)."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port not in taken:
            taken.add(port)
            return port


class Lab:
    """The processes of one run under ``folder``: bootstraps (``meshlearn bootstrap``) and etcd
    members, each dying with this process; ``close`` stops whatever is left."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.ports: set[int] = set()
        self.bootstraps: list[subprocess.Popen] = []
        self.addresses: list[str] = []
        self.members: list[EtcdMember] = []
        self.registry_args: list[str] = []
        self.client_tls: EtcdTls | None = None  # the operator's certificate, with a cluster

    def start_cluster(self, count: int) -> None:
        """``count`` etcd members with TLS, started and answering; bootstraps started after this
        keep their registry in it."""
        tls_folder = self.folder / "tls"
        self.client_tls = make_cluster_certs(tls_folder, ["127.0.0.1"])
        specs = [MemberSpec(f"m{i}", "127.0.0.1", free_port(self.ports), free_port(self.ports),
                            self.folder / f"m{i}") for i in range(count)]
        self.members = [EtcdMember(spec, specs, member_tls(tls_folder)) for spec in specs]
        for member in self.members:
            member.start()
        for member in self.members:
            member.wait_ready(READY_S)
        self.registry_args = ["--registry", "etcd://" + ",".join(f"{s.host}:{s.client_port}" for s in specs),
                              "--registry-tls", str(tls_folder)]

    def start_bootstraps(self, count: int) -> None:
        """``count`` bootstraps (on the cluster if one was started, else each on its SQLite file),
        started together; returns once every one serves, its pinned address in ``addresses``."""
        for i in range(count):
            folder = self.folder / f"bootstrap{i}"
            folder.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, "-m", "meshlearn", "bootstrap", "--host", "127.0.0.1",
                       "--port", str(free_port(self.ports)), "--relay-port", "0", "--dial-back", "false",
                       "--ttl", str(PROVIDER_TTL), "--state", str(folder / "registry.sqlite"),
                       "--key", str(folder / "bootstrap.key"), *self.registry_args]
            env = {**os.environ, "MESHLEARN_SECRET": SECRET, "MESHLEARN_HOME": str(folder), "PYTHONUNBUFFERED": "1"}
            with open(folder / "bootstrap.log", "w") as log:
                self.bootstraps.append(subprocess.Popen(dying_with_this_process(command), stdout=log,
                                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))
        self.addresses = [self._served_at(i) for i in range(count)]

    def _served_at(self, i: int) -> str:
        """Bootstrap ``i``'s pinned address, once its log says it serves."""
        log = self.folder / f"bootstrap{i}" / "bootstrap.log"
        deadline = time.monotonic() + READY_S
        while time.monotonic() < deadline:
            found = BOOTSTRAP_SAYS.search(log.read_text())
            if found:
                return found.group(1)
            if self.bootstraps[i].poll() is not None:
                raise RuntimeError(f"bootstrap {i} exited ({self.bootstraps[i].returncode}): {log.read_text()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(f"bootstrap {i} did not serve within {READY_S:g} s: see {log}")

    def leader(self) -> int:
        """The machine whose etcd member leads the cluster now."""
        specs = [member.spec for member in self.members]
        client = EtcdClient(client_urls(specs, True), self.client_tls)
        try:
            endpoint = client.leader_endpoint()
        finally:
            client.close()
        return client_urls(specs, True).index(endpoint)

    def kill_machine(self, i: int) -> None:
        """Machine ``i`` dies as in a crash: SIGKILL to its bootstrap and to its etcd member."""
        self.bootstraps[i].kill()
        self.members[i].kill()
        self.bootstraps[i].wait()

    def close(self) -> None:
        for proc in self.bootstraps:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for member in self.members:
            member.kill()


@contextlib.contextmanager
def started(folder: Path, setup: str) -> Iterator[Lab]:
    """Setup ``setup`` (a: one bootstrap on SQLite; b: a cluster of three, each member with a
    bootstrap), stopped whatever happens."""
    lab = Lab(folder)
    try:
        if setup == "b":
            lab.start_cluster(MEMBERS)
        lab.start_bootstraps(MEMBERS if setup == "b" else 1)
        yield lab
    finally:
        lab.close()


def register_providers(addresses: list[str], count: int) -> None:
    """``count`` providers p0, p1, ..., each registering with a key pair of its own, through the
    bootstraps in turn; every bootstrap must then list them all (one registry behind all)."""
    for i in range(count):
        pid = f"p{i}"
        info = Register(id=pid, address=f"127.0.0.1:{20000 + i}", ram_gb=1.0, cores=1, device="cpu")
        reply = ask(addresses[i % len(addresses)], rpcs.REGISTER, info, SECRET.encode(), keys=KeyPair.generate(),
                    timeout=ASK_S)
        if reply.registered != pid:
            raise RuntimeError(f"{pid} was not registered: {reply}")
    for address in addresses:
        listed = ask(address, rpcs.DISCOVER, Discover(count=count), SECRET.encode(), keys=KeyPair.generate(),
                     timeout=ASK_S).providers
        if len(listed) != count:
            raise RuntimeError(f"{address} lists {len(listed)} providers, not {count}")


def claim_and_release(address: str, task: str, keys: KeyPair) -> float:
    """Claim one provider for ``task`` through ``address``, then release it; the claim's round trip, s."""
    began = time.perf_counter()
    taken = ask(address, rpcs.CLAIM, Claim(task=task, count=1, attempt=task), SECRET.encode(), keys=keys,
                timeout=ASK_S)
    took = time.perf_counter() - began
    if len(taken.providers) != 1:
        raise RuntimeError(f"claim {task} took {len(taken.providers)} providers, not 1")
    ask(address, rpcs.RELEASE, Release(task=task), SECRET.encode(), keys=keys, timeout=ASK_S)
    return took


def timed_claims(addresses: list[str], count: int, tag: str) -> list[float]:
    """``count`` sequential claim+release pairs of one client, through the bootstraps in turn:
    each claim's round trip in ms."""
    keys = KeyPair.generate()
    return [1000 * claim_and_release(addresses[k % len(addresses)], f"{tag}-{k}", keys) for k in range(count)]


def contended_claims(addresses: list[str], count: int) -> tuple[list[float], int]:
    """``timed_claims`` while CONTENDERS other clients claim and release without pause (each has
    claimed once before the timing starts); the round trips in ms, and the others' claims."""
    stop, failures, done = threading.Event(), [], [0] * CONTENDERS
    warmed = threading.Barrier(CONTENDERS + 1)

    def contend(j: int) -> None:
        keys = KeyPair.generate()
        try:
            while True:
                claim_and_release(addresses[(done[j] + j + 1) % len(addresses)], f"other{j}-{done[j]}", keys)
                done[j] += 1
                if done[j] == 1:
                    warmed.wait(READY_S)
                if stop.is_set():
                    return
        except Exception as exc:  # noqa: BLE001 -- reported by the main thread, which fails the run
            failures.append(exc)
            warmed.abort()

    threads = [threading.Thread(target=contend, args=(j,), daemon=True) for j in range(CONTENDERS)]
    for thread in threads:
        thread.start()
    times: list[float] = []
    try:
        warmed.wait(READY_S)
        times = timed_claims(addresses, count, "contended")
    except threading.BrokenBarrierError:
        pass  # a contending client failed (its error is raised below), or never claimed
    finally:
        stop.set()
        for thread in threads:
            thread.join(READY_S)
    if failures or not times:
        raise RuntimeError(f"a contending client failed: {failures[0] if failures else 'no claim within READY_S'}")
    return times, sum(done)


def until(succeeds: Callable[[], bool], began: float, what: str) -> float:
    """Seconds from ``began`` (monotonic) until ``succeeds()`` first returns True."""
    while not succeeds():
        if time.monotonic() - began > GIVE_UP_S:
            raise RuntimeError(f"{what}: not after {GIVE_UP_S:g} s")
    return time.monotonic() - began


def revoke_reach(lab: Lab) -> dict:
    """Revoke a fresh key with ``meshlearn revoke --registry``: the command's own seconds, the
    seconds from its return until every bootstrap refuses the key (each one admitted it before),
    and the passes over the bootstraps that took (1: each refused the first time it was asked)."""
    keys = KeyPair.generate()
    for address in lab.addresses:
        ask(address, rpcs.BOOTSTRAP_PING, Empty(), SECRET.encode(), keys=keys, timeout=ASK_S)
    began = time.monotonic()
    revoke = subprocess.run([sys.executable, "-m", "meshlearn", "revoke", *lab.registry_args, "--", keys.text],
                            capture_output=True, text=True, timeout=GIVE_UP_S, check=False)
    returned = time.monotonic()
    if revoke.returncode != 0:
        raise RuntimeError(f"meshlearn revoke failed: {revoke.stderr.strip()}")
    refusing: set[str] = set()
    passes = [0]

    def everyone_refuses() -> bool:
        passes[0] += 1
        for address in lab.addresses:
            if address not in refusing:
                try:
                    ask(address, rpcs.BOOTSTRAP_PING, Empty(), SECRET.encode(), keys=keys, timeout=ASK_S)
                except KeyRefused:
                    refusing.add(address)
        if len(refusing) < len(lab.addresses):
            time.sleep(POLL_S)
            return False
        return True

    reach = until(everyone_refuses, returned, "a revoked key still admitted")
    return {"revoke_command_s": returned - began, "revoke_reach_s": reach, "revoke_passes": passes[0]}


def failover(lab: Lab) -> float:
    """SIGKILL the etcd leader's machine (its member and its bootstrap): seconds until a claim
    succeeds through the two others, asked as a requester asks its bootstraps (``Bootstraps``:
    the next one where one does not serve, round again while the cluster elects a new leader)."""
    dead = lab.leader()
    peers = Bootstraps([address for i, address in enumerate(lab.addresses) if i != dead])
    claim, keys = Claim(task="failover", count=1, attempt="failover"), KeyPair.generate()
    began = time.monotonic()
    lab.kill_machine(dead)
    taken = peers.ask(rpcs.CLAIM, claim, SECRET.encode(), keys=keys, timeout=ASK_S)
    took = time.monotonic() - began
    if len(taken.providers) != 1:
        raise RuntimeError(f"the claim after the kill took {len(taken.providers)} providers, not 1")
    return took


def percentile(values: list[float], q: int) -> float:
    """The ``q``-th percentile of ``values`` (inclusive: between the smallest and the largest)."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def one_run(folder: Path, setup: str, args: argparse.Namespace, number: int) -> dict:
    """Setup ``setup`` started afresh, measured, stopped: the run's row."""
    row = {"run": number, "setup": setup, "what": SETUPS[setup], "providers": args.providers,
           "claims": args.claims, "load_1m": os.getloadavg()[0]}
    began = time.monotonic()
    with started(folder, setup) as lab:
        register_providers(lab.addresses, args.providers)
        alone = timed_claims(lab.addresses, args.claims, "alone")
        contended, others = contended_claims(lab.addresses, args.claims)
        row.update(p50_ms=statistics.median(alone), p99_ms=percentile(alone, 99),
                   contended_p50_ms=statistics.median(contended), contended_p99_ms=percentile(contended, 99),
                   other_claims=others)
        if setup == "b":
            row.update(revoke_reach(lab))
            row["failover_s"] = failover(lab)
    row["wall_s"] = time.monotonic() - began
    return row


def spread(values: list[float]) -> dict:
    """A figure over runs: its median and range."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summary(rows: list[dict]) -> dict:
    """Per setup, the median and range of each measured figure over its runs."""
    return {setup: {figure: spread([row[figure] for row in rows if row["setup"] == setup])
                    for figure in FIGURES if any(figure in row for row in rows if row["setup"] == setup)}
            for setup in SETUPS}


def table(figures: dict) -> str:
    """``summary``'s figures as a Markdown table: per setup, each figure's median (range)."""
    def cell(spread_: dict | None) -> str:
        if spread_ is None:
            return "-"
        return f"{spread_['median']:.3g} ({spread_['min']:.3g}-{spread_['max']:.3g})"

    lines = ["| setup | " + " | ".join(FIGURES.values()) + " |", "|---" * (len(FIGURES) + 1) + "|"]
    for setup, what in SETUPS.items():
        lines.append(f"| {setup}: {what} | " + " | ".join(cell(figures[setup].get(name)) for name in FIGURES) + " |")
    return "\n".join(lines)


def rounded(value):
    """``value`` with its floats cut to 4 decimals (for printing)."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {key: rounded(item) for key, item in value.items()}
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs, a then b (default 3)")
    parser.add_argument("--claims", type=int, default=200, help="claims timed per run, alone and again "
                        "contended (default 200)")
    parser.add_argument("--providers", type=int, default=32, help="providers registered per run (default 32)")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, registries)")
    args = parser.parse_args(argv)
    if not CONTENDERS + 1 <= args.providers <= MAX_PROVIDERS_PER_ADDRESS:
        parser.error(f"--providers {args.providers}: give {CONTENDERS + 1} to {MAX_PROVIDERS_PER_ADDRESS} "
                     f"(every claimer holds one at a time; a bootstrap takes {MAX_PROVIDERS_PER_ADDRESS} per address)")
    if args.claims < 2 or args.pairs < 1:
        parser.error("give --claims 2 or more (a percentile needs two) and --pairs 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if etcd_binary() is None:
        sys.exit(missing_etcd_message())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the runs' processes on the way out
    root = Path(tempfile.mkdtemp(prefix="meshlearn-claims-"))
    rows = []
    try:
        for number, setup in enumerate("ab" * args.pairs, start=1):
            rows.append(one_run(root / f"run-{number}-{setup}", setup, args, number))
            print(json.dumps(rounded(rows[-1])), flush=True)
    except BaseException:
        print(f"stopped; the runs' logs are in {root}", file=sys.stderr)
        raise
    figures = summary(rows)
    print(json.dumps({"summary": rounded(figures)}), flush=True)
    print(f"median (range) over {args.pairs} run(s) per setup, {args.claims} claims each, "
          f"{args.providers} providers:\n{table(figures)}", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
