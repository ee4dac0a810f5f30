"""Gossip: interpolation rules, peer scores, the pull endpoint, the dpwa adapter and config, runs."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
import zmq
from helpers.waiting import wait_until
from torch import nn

from meshlearn.adapter import DpwaPyTorchAdapter, GossipAdapter, load_gossip_config
from meshlearn.config import make_config
from meshlearn.definitions.gossipstate import PeerScores, interpolation_factor
from meshlearn.definitions.settings import GossipSettings
from meshlearn.errors import ConfigError
from meshlearn.flat import FlatState
from meshlearn.sim import simulate
from meshlearn.transport.pull import PullEndpoint
from meshlearn.wire import Kind, Message, encode

ROOT = Path(__file__).resolve().parents[1]
DPWA_SAMPLE = """\
- nodes:
  - {name: w1, host: localhost, port: 45000}
  - {name: w2, host: localhost, port: 45001}
- fetch_probability: 1
- timeout_ms: 2500
- interpolation: constant   # clock | loss | constant
- divergence_threshold: 0.2
- constant: { value: 0.5 }
- clock: 0
- loss: 0
"""
DPWA_SAMPLE_DATA = yaml.safe_load(DPWA_SAMPLE)


def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _group(ports, timeout_ms=300, **extra):
    return {"nodes": [{"name": f"w{i}", "host": "127.0.0.1", "port": p} for i, p in enumerate(ports)],
            "timeout_ms": timeout_ms, **extra}


# --- interpolation --------------------------------------------------------------------------

def test_interpolation_formulas_by_hand():
    constant = GossipSettings(interpolation="constant", value=0.3)
    assert interpolation_factor(constant, 10, 90, 1.0, 2.0) == pytest.approx(0.3)
    clock = GossipSettings(interpolation="clock")
    assert interpolation_factor(clock, 30, 90, 1.0, 2.0) == pytest.approx(90 / 120)
    assert interpolation_factor(clock, 0, 0, 1.0, 2.0) == pytest.approx(0.5)
    by_loss = GossipSettings(interpolation="loss")
    assert interpolation_factor(by_loss, 1, 1, 3.0, 1.0) == pytest.approx(0.75)  # my loss is worse: take more
    assert interpolation_factor(by_loss, 1, 1, 1.0, 3.0) == pytest.approx(0.25)


def test_divergence_threshold_scales_the_factor_below_it():
    settings = GossipSettings(interpolation="constant", value=0.5, divergence_threshold=0.2)
    assert interpolation_factor(settings, 1, 1, 0.05, 1.0) == pytest.approx(0.5 * 0.05 / 0.2)
    assert interpolation_factor(settings, 1, 1, 0.5, 1.0) == pytest.approx(0.5)  # above: unchanged
    by_loss = GossipSettings(interpolation="loss", divergence_threshold=0.2)
    assert interpolation_factor(by_loss, 1, 1, 0.1, 0.3) == pytest.approx(0.25 * 0.5)


def test_bad_settings_are_config_errors():
    with pytest.raises(ConfigError, match="interpolation"):
        GossipSettings(interpolation="median")
    with pytest.raises(ConfigError):
        GossipSettings(fetch_probability=1.5)


# --- peer scores ----------------------------------------------------------------------------

def test_scores_pick_a_failing_peer_rarely_and_recover_it():
    import random

    scores = PeerScores([0, 1, 2, 3], random.Random(3))
    for _ in range(20):
        scores.failure(3)
    assert scores.score[3] == PeerScores.LOW
    picks = [scores.pick() for _ in range(4000)]
    share = picks.count(3) / len(picks)
    assert 0 < share < 0.05  # rarely, but still retried
    for _ in range(200):
        scores.success(3)
    assert scores.score[3] == PeerScores.HIGH
    assert scores.score[0] == PeerScores.START


# --- config ---------------------------------------------------------------------------------

def test_dpwa_sample_config_loads_as_is(tmp_path):
    path = tmp_path / "dpwa.yaml"
    path.write_text(DPWA_SAMPLE)
    config = load_gossip_config(path)
    assert [n.name for n in config.nodes] == ["w1", "w2"] and config.nodes[1].port == 45001
    settings = config.settings()
    assert (settings.fetch_probability, settings.timeout, settings.interpolation, settings.value,
            settings.divergence_threshold) == (1, 2.5, "constant", 0.5, 0.2)
    same = tmp_path / "meshlearn.yaml"
    same.write_text("nodes:\n  - {name: w1, host: localhost, port: 45000}\n  - {name: w2, host: localhost, port: 45001}\n"
                    "timeout_ms: 2500\ndivergence_threshold: 0.2\nconstant: 0.5\n")
    assert load_gossip_config(same).settings() == settings
    assert settings.fresh  # meshlearn's fetch by default; dpwa's with `fresh: false`
    assert not load_gossip_config(DPWA_SAMPLE_DATA + [{"fresh": False}]).settings().fresh


@pytest.mark.parametrize("text, match", [
    ("- nodes: []\n", "nodes"),
    (DPWA_SAMPLE.replace("constant   #", "median   #"), "interpolation"),
    (DPWA_SAMPLE.replace("port: 45001", "port: 70000"), "port"),
    (DPWA_SAMPLE.replace("name: w2", "name: w1"), "unique"),
    (DPWA_SAMPLE + "- timeout_ms: 10\n", "twice"),
    (DPWA_SAMPLE + "- speed: 3\n", "speed"),
    (DPWA_SAMPLE + "- fresh: sometimes\n", "fresh"),
    ("- nodes: [\n", "not valid YAML"),
    ("42\n", "list of one-key maps"),
])
def test_malformed_configs_give_one_clear_line(tmp_path, text, match):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        load_gossip_config(path)
    assert "\n" not in str(info.value)


def test_unknown_worker_name():
    with pytest.raises(ConfigError, match="no node named 'w9'"):
        GossipAdapter(nn.Linear(2, 2), "w9", _group([45000, 45001]))


# --- adapters in one process: a dead peer -----------------------------------------------------

def test_dead_peer_is_fetched_rarely_never_blocks_and_is_used_again_when_back():
    ports = _free_ports(4)
    config = _group(ports, timeout_ms=200)
    torch.manual_seed(0)
    adapters = [DpwaPyTorchAdapter(nn.Linear(8, 4), f"w{i}", config, seed=i) for i in range(3)]  # w3 is dead
    try:
        for a in adapters:
            a.start()
        me = adapters[0]
        picked, slowest, floor_at = [], 0.0, None
        for step in range(400):
            for a in adapters[1:]:
                a.update_send(1.0)
            me.update_send(1.0)
            started = time.monotonic()
            record = me.update_wait(1.0)
            slowest = max(slowest, time.monotonic() - started)
            for a in adapters[1:]:
                a.update_wait(1.0)
            picked.append(record["fetched"])
            if floor_at is None and me.scores["w3"] == PeerScores.LOW:
                floor_at = step + 1
            if floor_at is not None and step + 1 - floor_at >= 150:
                break
        assert slowest < 0.2 + 0.3  # never blocked past timeout_ms (plus scheduling slack)
        assert floor_at is not None and me.scores["w3"] == PeerScores.LOW  # at the floor after its failures
        assert picked[:floor_at].count(3) >= 10  # it was tried ...
        assert picked[floor_at:].count(3) <= 12  # ... and then rarely picked (about 1.3% expected)
        # w3 comes back: it answers, its score climbs, and it is fetched from again
        back = DpwaPyTorchAdapter(nn.Linear(8, 4), "w3", config, seed=3)
        adapters.append(back)
        back.update_send(1.0)
        used = 0
        for _ in range(4000):  # about 1.3% of picks go to a peer at the floor: expect ~150 steps per use
            me.update_send(1.0)
            record = me.update_wait(1.0)
            used += record["fetched"] == 3 and not record.get("failed")
            if used >= 2:
                break
        assert used >= 2 and me.scores["w3"] > 10.0
    finally:
        for a in adapters:
            a.close()


def test_peers_get_the_trained_state_before_it_is_merged():
    """update_wait publishes the state just trained (before interpolating), so a peer's fetch
    carries the latest gradient step; dpwa's order would hand out the state from before it."""
    config = _group(_free_ports(2), timeout_ms=1000)
    torch.manual_seed(0)
    a, b = (GossipAdapter(nn.Linear(4, 2), f"w{i}", config, seed=i) for i in range(2))
    try:
        a.start()
        b.start()
        b.update_send(1.0)
        b.update_wait(1.0)  # w0 has published nothing yet: a failed fetch, b unchanged
        b0 = [p.detach().clone() for p in b.model.parameters()]
        a.update_send(1.0)
        with torch.no_grad():  # "training": a step that moves every parameter by 1
            for p in a.model.parameters():
                p += 1.0
        a1 = [p.detach().clone() for p in a.model.parameters()]
        assert a.update_wait(1.0)["factor"] == pytest.approx(0.5)
        for p, x, y in zip(a.model.parameters(), a1, b0):
            assert torch.allclose(p, (x + y) / 2)
        b.update_send(1.0)
        record = b.update_wait(1.0)
        assert record["fetched"] == 0 and not record.get("failed")
        for p, x, y in zip(b.model.parameters(), a1, b0):
            assert torch.allclose(p, (x + y) / 2)  # took a's trained state, not its merged or older one
    finally:
        a.close()
        b.close()


def test_a_peer_whose_clock_or_loss_is_not_a_number_is_not_merged():
    ports = _free_ports(2)
    me = GossipAdapter(nn.Linear(4, 2), "w0", _group(ports, timeout_ms=1000, interpolation="clock"))
    rogue = PullEndpoint(1, "127.0.0.1", ports[1])  # speaks the protocol, sends odd metadata
    torch.manual_seed(1)
    state = FlatState(nn.Linear(4, 2))
    try:
        rogue.bind()
        rogue.connect({0: f"tcp://127.0.0.1:{ports[0]}"})  # it serves only the peers it knows
        me.start()
        before = [p.detach().clone() for p in me.model.parameters()]
        for meta in ({"clock": "soon", "loss": 1.0}, {"clock": -3.0, "loss": 1.0}, {"clock": 2.0, "loss": [1]},
                     {"clock": True, "loss": 1.0}):
            rogue.publish(state.segments_of(state.state.clone()), meta)
            me.update_send(1.0)
            record = me.update_wait(1.0)
            assert record["fetched"] == 1 and record.get("failed") == 1, meta
            assert all(torch.equal(a, b) for a, b in zip(before, me.model.parameters()))
        assert me.scores["w1"] < PeerScores.START
        rogue.publish(state.segments_of(state.state.clone()), {"clock": 4.0, "loss": 1.0})
        me.update_send(1.0)
        record = me.update_wait(1.0)  # well-formed again: merged with factor 4 / (5 + 4)
        assert not record.get("failed") and record["factor"] == pytest.approx(4 / 9)
    finally:
        me.close()
        rogue.close()


def test_refused_and_unserved_peers_do_not_crash():
    ports = _free_ports(2)
    lonely = GossipAdapter(nn.Linear(3, 3), "w0", _group(ports, timeout_ms=100))
    try:
        before = [p.clone() for p in lonely.model.parameters()]
        for _ in range(3):
            lonely.update_send(0.5)
            record = lonely.update_wait(0.5)
            assert record.get("failed") == 1
        assert all(torch.equal(a, b) for a, b in zip(before, lonely.model.parameters()))
        assert lonely.clock == 3
    finally:
        lonely.close()


# --- fresh fetches: a server holds a request for the state it is about to publish -------------

def _pair(b_knows=None):
    """Two connected pull endpoints, node 0 and node 1, on loopback (1 also serves ``b_knows``)."""
    a, b = PullEndpoint(0), PullEndpoint(1)
    a.bind(), b.bind()
    a.connect({1: b.address})
    b.connect({0: a.address, **(b_knows or {})})
    return a, b


def _wait_until(condition, seconds=10.0):
    assert wait_until(condition, seconds), "condition not reached"


def _value(message):
    return message.tensors["w"][0].item()


def test_a_held_fetch_gets_the_state_published_while_it_waits_and_a_plain_one_does_not():
    a, b = _pair()
    try:
        b.publish({"w": torch.full((3,), 1.0)}, {"clock": 1.0})
        held = a.fetch(1, timeout=10.0, wait=1.5)
        _wait_until(lambda: b.requests_held == 1)  # held, not answered at once ...
        assert not held.done()  # ... and not answered before a newer state comes or the wait ends
        b.publish({"w": torch.full((3,), 2.0)}, {"clock": 2.0})
        assert _value(held.result()) == 2.0  # answered at the end of its wait with the newest state
        assert _value(a.fetch(1, timeout=10.0).result(timeout=5.0)) == 2.0  # dpwa's fetch: what it has, at once
        b.publish({"w": torch.full((3,), 3.0)}, {"clock": 3.0})
        quiet = a.fetch(1, timeout=10.0, wait=0.2)
        assert _value(quiet.result()) == 3.0  # nothing newer within the wait: what it has
    finally:
        a.close()
        b.close()


def test_a_held_fetch_gets_the_last_state_published_before_its_wait_ends():
    a, b = _pair()
    published, stop = [0], threading.Event()

    def train():
        while not stop.is_set():
            published[0] += 1
            b.publish({"w": torch.full((3,), float(published[0]))}, {})
            time.sleep(0.05)

    thread = threading.Thread(target=train)
    thread.start()
    try:
        _wait_until(lambda: published[0] >= 6)  # the server learns how often it publishes
        for _ in range(3):
            asked_at = published[0]
            got = _value(a.fetch(1, timeout=10.0, wait=0.6).result())
            assert got >= asked_at + 3  # about twelve publications in the wait: not the first one after asking
    finally:
        stop.set()
        thread.join()
        a.close()
        b.close()


def test_a_closing_server_answers_the_requests_it_holds():
    a, b = _pair()
    try:
        b.publish({"w": torch.full((3,), 7.0)}, {})
        assert a.fetch(1, timeout=10.0).result() is not None  # connected
        held = a.fetch(1, timeout=30.0, wait=8.0)
        _wait_until(lambda: b.requests_held == 1)
        b.close()
        assert _value(held.result(timeout=5.0)) == 7.0  # not a timeout: answered on the way out
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("wait", ["soon", -1.0, [0.1], True])
def test_a_request_with_a_bad_wait_is_dropped_and_the_server_keeps_serving(wait):
    a, b = _pair({2: "tcp://127.0.0.1:9"})  # node 2: a peer b serves, played by a raw socket here
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        b.publish({"w": torch.full((3,), 5.0)}, {})
        dealer.setsockopt(zmq.ROUTING_ID, struct.pack("<I", 2))
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(b.address)
        dealer.send_multipart(encode(Message(Kind.REQUEST, 2, 99, meta={"wait": wait})))
        assert not dealer.poll(500)  # no answer ...
        assert b.stats.malformed_dropped == 1  # ... and counted as malformed
        assert _value(a.fetch(1, timeout=5.0, wait=0.1).result()) == 5.0
    finally:
        dealer.close()
        a.close()
        b.close()


@pytest.mark.parametrize("fresh", [True, False])
def test_the_adapter_merges_the_state_a_peer_finishes_during_its_step(fresh):
    """With ``fresh`` a worker's fetch is held until the peer publishes the step it is training,
    so the merge includes that step; dpwa's fetch merges the state from before it."""
    config = _group(_free_ports(2), timeout_ms=5000, fresh=fresh)
    torch.manual_seed(0)
    a, b = (GossipAdapter(nn.Linear(4, 2), f"w{i}", config, seed=i) for i in range(2))
    try:
        b.update_send(1.0)
        b.update_wait(1.0)  # b publishes its first state (its fetch from a, not started yet, fails)
        a.update_send(1.0)
        time.sleep(0.8)  # a's step: it learns that its steps take about this long
        a.update_wait(1.0)
        b_before = [p.detach().clone() for p in b.model.parameters()]
        a_before = [p.detach().clone() for p in a.model.parameters()]
        a.update_send(1.0)
        # a trains; its request has reached b (held, or with dpwa's fetch answered: b's second answer to a)
        _wait_until(lambda: b.endpoint.requests_held == 1 if fresh else b.endpoint.requests_served == 2)
        b.update_send(1.0)
        with torch.no_grad():  # b trains a step that moves every parameter by 1
            for p in b.model.parameters():
                p += 1.0
        b.update_wait(1.0)  # ... and publishes it
        record = a.update_wait(1.0)
        assert not record.get("failed")
        shift = 1.0 if fresh else 0.0
        for p, mine, peer in zip(a.model.parameters(), a_before, b_before):
            assert torch.allclose(p, (mine + peer + shift) / 2)
    finally:
        a.close()
        b.close()


# --- real processes -------------------------------------------------------------------------

def _train_workers(tmp_path, count: int, flags: list[str]) -> list[str]:
    """Run ``count`` workers of examples/gossip_train.py with ``flags`` on loopback (worker i writes
    its result to ``w{i}.json``); their outputs. Every one is killed if the test fails."""
    config = tmp_path / "group.yaml"
    config.write_text(json.dumps(_group(_free_ports(count), timeout_ms=1000)))
    procs, outs = [], []
    try:
        for i in range(count):
            procs.append(subprocess.Popen(
                [sys.executable, str(ROOT / "examples" / "gossip_train.py"), "--config", str(config), "--name", f"w{i}",
                 *flags, "--result", str(tmp_path / f"w{i}.json")],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True))
        for proc in procs:
            outs.append(proc.communicate(timeout=240)[0])
            assert proc.returncode == 0, outs[-1]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return outs


@pytest.mark.slow  # test_readme's tour 2 trains four adapter workers in the default run
def test_four_workers_with_the_adapter_reach_90_percent_and_converge(tmp_path):
    _train_workers(tmp_path, 4, ["--dataset", "digits", "--model", "mlp", "--epochs", "40", "--batch-size", "16",
                                 "--lr", "0.05"])
    results = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(4)]
    assert np.mean([r["accuracy"] for r in results]) >= 0.90, results
    params = np.stack([np.load(tmp_path / f"w{i}.json.npy") for i in range(4)])  # (worker, [initial, final], P)

    def spread(models):
        return float(np.linalg.norm(models - models.mean(0), axis=1).mean())

    assert spread(params[:, 1]) < 0.25 * spread(params[:, 0])  # different starts, close at the end


@pytest.mark.slow  # test_readme's tour 2 runs adapter workers, test_language_model a quick GPT, in the default run
def test_two_workers_with_the_adapter_train_a_small_gpt_on_the_standard_library(tmp_path):
    outs = _train_workers(tmp_path, 2, ["--dataset", "pystdlib", "--model", "gpt-tiny", "--context", "32",
                                        "--optimizer", "adamw", "--lr", "0.003", "--steps", "40", "--batch-size", "16"])
    results = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in range(2)]
    for result, out in zip(results, outs):
        assert result["perplexity"] < 40 < 256, out  # from a uniform guess over 256 bytes
        assert result["scores"] and "perplexity" in out
    params = np.stack([np.load(tmp_path / f"w{i}.json.npy") for i in range(2)])  # (worker, [initial, final], P)
    # different starts, pulled together by gossip: the two models are closer than they began
    assert np.linalg.norm(params[0, 1] - params[1, 1]) < 0.5 * np.linalg.norm(params[0, 0] - params[1, 0])


def test_simulate_with_gossip_writes_the_usual_results(tmp_path):
    config = make_config({"algorithm": "gossip", "nodes": 4, "topology": "full", "iterations": 60, "test_after": 20,
                          "rounds": 2, "batch_size": 16, "fetch_timeout": 1.0, "output": str(tmp_path / "run")})
    result = simulate(config, progress=False)
    for name in ("config.yaml", "graph.txt", "summary.csv", "summary.json", "accuracy.png", "loss.png"):
        assert (result.output / name).is_file(), name
    summary = json.loads((result.output / "summary.json").read_text())
    assert summary["final"]["accuracy"] > 0.6
    stats = [node["stats"] for node in summary["per_node"].values()]
    assert sum(s["fetches"] for s in stats) >= 4 * 50 and sum(s["requests_served"] for s in stats) > 0


def test_gossip_needs_tcp():
    with pytest.raises(ConfigError, match="use transport tcp"):
        make_config({"algorithm": "gossip", "transport": "udp"})


def test_slowdown_settings():
    config = make_config({"slowdown": "*:+20ms,0:3"})
    assert config.slowdown_of(0) == (3.0, 0.0) and config.slowdown_of(5) == (1.0, 0.02)
    assert make_config({}).slowdown_of(0) == (1.0, 0.0)
    for bad in ("0:0.5", "x:3", "0:+abc", "0"):
        with pytest.raises(ConfigError, match="slowdown"):
            make_config({"slowdown": bad})


# --- hostile or odd input (issue 15) --------------------------------------------------------

def test_a_hung_peer_sits_out_more_picks_after_each_failure_in_a_row():
    import random

    scores = PeerScores([0, 1], random.Random(5))
    picks_of_hung = 0
    for _ in range(2000):  # peer 1 accepts connections but never answers: every pick of it fails
        peer = scores.pick()
        if peer == 1:
            picks_of_hung += 1
            scores.no_answer(1)
        elif peer == 0:
            scores.success(0)
    assert picks_of_hung <= 2000 / PeerScores.MAX_BACKOFF + 10  # dpwa's scores alone: about 6% (~120)
    scores.success(1)  # it answers again: back in play at once
    assert scores.sitting_out[1] == 0 and scores.failures[1] == 0


def test_every_peer_sitting_out_means_no_fetch_this_step():
    import random

    scores = PeerScores([0], random.Random(1))
    scores.no_answer(0)
    scores.no_answer(0)
    assert scores.pick() == 0  # two misses: still tried
    scores.no_answer(0)
    assert [scores.pick() for _ in range(3)] == [None, None, 0]


def test_the_loss_rule_counts_negative_losses_as_zero():
    by_loss = GossipSettings(interpolation="loss")
    assert interpolation_factor(by_loss, 1, 1, -2.0, -1.0) == pytest.approx(0.5)
    assert interpolation_factor(by_loss, 1, 1, 1.0, -3.0) == pytest.approx(1.0)  # the peer fits better: take it


@pytest.mark.parametrize("interpolation", ["constant", "clock", "loss"])
def test_negative_losses_still_merge(interpolation):
    """A loss below zero (a log-likelihood objective) used to make every fetch count as failed."""
    config = _group(_free_ports(2), timeout_ms=1000, interpolation=interpolation)
    torch.manual_seed(0)
    a, b = (GossipAdapter(nn.Linear(4, 2), f"w{i}", config, seed=i) for i in range(2))
    try:
        a.start(), b.start()
        b.update_send(-1.5)
        b.update_wait(-1.5)
        merged = 0
        for _ in range(5):
            a.update_send(-2.0)
            record = a.update_wait(-2.0)
            merged += record["fetched"] == 1 and not record.get("failed")
        assert merged == 5
    finally:
        a.close(), b.close()


def test_a_diverged_peer_is_not_merged_and_a_diverged_worker_takes_its_peer():
    config = _group(_free_ports(2), timeout_ms=1000, interpolation="loss")
    torch.manual_seed(0)
    a, b = (GossipAdapter(nn.Linear(4, 2), f"w{i}", config, seed=i) for i in range(2))
    try:
        a.start(), b.start()
        b.update_send(float("inf"))
        b.update_wait(float("inf"))  # b diverged: publishes its loss as unknown
        before = [p.detach().clone() for p in a.model.parameters()]
        a.update_send(1.0)
        record = a.update_wait(1.0)
        assert record.get("diverged") == 1 and record["factor"] == 0.0  # an infinite loss no longer looks perfect
        assert all(torch.equal(x, y) for x, y in zip(before, a.model.parameters()))
        b.update_send(float("nan"))
        record = b.update_wait(float("nan"))  # a's loss is 1.0: the diverged worker takes a's state whole
        assert record["factor"] == pytest.approx(1.0)
        assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters()))
    finally:
        a.close(), b.close()


def test_dpwa_keyword_names_are_accepted():
    config = _group(_free_ports(2))
    adapter = DpwaPyTorchAdapter(net=nn.Linear(2, 2), name="w0", config_file=config)
    adapter.close()
    with pytest.raises(TypeError, match="not both"):
        GossipAdapter(nn.Linear(2, 2), "w0", config, net=nn.Linear(2, 2))


@pytest.mark.parametrize("convert", [lambda m: m.double(), lambda m: m.to(torch.float16)])
def test_a_model_converted_after_the_adapter_was_built_is_a_clear_error(convert):
    from meshlearn.errors import ModelError

    model = nn.Linear(3, 2)
    adapter = GossipAdapter(model, "w0", _group(_free_ports(2), timeout_ms=100))
    try:
        adapter.update_send(1.0)
        adapter.update_wait(1.0)
        convert(model)
        with pytest.raises(ModelError, match="converted or moved"):
            adapter.update_send(1.0)
    finally:
        adapter.close()


def test_a_serving_thread_that_dies_is_raised_in_the_nodes_own_thread(monkeypatch):
    """It used to die silently: its neighbours then timed out on every fetch and the run said success."""
    from meshlearn.errors import ThreadFailed

    a, b = _pair()
    try:
        def broken(held, closing):
            raise RuntimeError("a bug in the serving loop")

        monkeypatch.setattr(b, "_answer_held", broken)
        b.poke()
        _wait_until(lambda: b._server.failure is not None)
        with pytest.raises(ThreadFailed, match="PullEndpoint-1 thread failed .RuntimeError: a bug"):
            b.check()
        a.check()  # the other endpoint is fine
    finally:
        a.close()
        b.close()


def test_a_crashing_request_shape_is_dropped_and_the_server_keeps_serving():
    from helpers.frames import empty_tensor_with_a_huge_dimension

    a, b = _pair()
    try:
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as rogue:
            rogue.setsockopt(zmq.LINGER, 0)
            rogue.connect(b.address)
            rogue.send_multipart(empty_tensor_with_a_huge_dimension(kind=Kind.REQUEST, sender=0))
            _wait_until(lambda: b.stats.malformed_dropped == 1)
        b.publish({"w": torch.tensor([4.0])}, {})
        assert _value(a.fetch(1, timeout=5).result(timeout=10)) == 4.0
        b.check()
    finally:
        a.close()
        b.close()


def test_a_tcp_self_connect_is_dropped_so_the_peer_can_take_its_port():
    """dpwa-style ports lie in the ephemeral range: a reconnect to a peer not up yet can get the
    peer's port as its own source port. Forced here with ZeroMQ's source-address syntax."""
    from meshlearn.errors import PortInUseError

    port = _free_ports(1)[0]
    a = PullEndpoint(0)
    a.bind()
    a.connect({1: f"tcp://127.0.0.1:{port};127.0.0.1:{port}"})
    caller = a.caller()
    late = PullEndpoint(1, "127.0.0.1", port)
    try:
        _wait_until(lambda: caller.call(1, 0.2) is None and caller.self_connects == 1)
        late.bind()  # the port is free again: without the check, PortInUseError for good
    except PortInUseError:
        pytest.fail("the self-connected socket kept the peer's port")
    finally:
        late.close()
        a.close()


def test_the_adapter_listens_from_its_constructor_as_dpwa_does():
    ports = _free_ports(2)
    config = _group(ports, timeout_ms=2000)
    torch.manual_seed(0)
    a = GossipAdapter(nn.Linear(4, 2), "w0", config)  # built, never called
    b = GossipAdapter(nn.Linear(4, 2), "w1", config)
    try:
        a.averager._publish(1.0)  # what a first update_send would do, minus the fetch
        b.update_send(1.0)
        record = b.update_wait(1.0)
        assert record["fetched"] == 0 and not record.get("failed")
    finally:
        a.close()
        b.close()


def test_extra_keys_on_a_node_are_a_warning_not_an_error():
    """dpwa's users' files may carry per-node extras such as ``gpu: 0``; dpwa ignores them."""
    with pytest.warns(UserWarning, match="node 'w2': unknown key 'gpu' ignored"):
        config = load_gossip_config(yaml.safe_load(DPWA_SAMPLE.replace("port: 45001}", "port: 45001, gpu: 0}")))
    assert [node.port for node in config.nodes] == [45000, 45001]
