"""Typed settings owned by each component, composed by the experiment config, the adapter config and
the task spec; flat names, flags and files that worked before keep working."""

import pytest
import yaml

from meshlearn.adapter import load_gossip_config
from meshlearn.cli.main import _resolve, build_parser
from meshlearn.config import ExperimentConfig, make_config
from meshlearn.definitions.settings import GossipSettings, LeaderSettings
from meshlearn.errors import BadMessage, ConfigError
from meshlearn.netem import NetemSpec
from meshlearn.network.task.spec import TaskSpec
from meshlearn.transport.settings import TcpSettings, UdpSettings

# Every setting an experiment file or flag could name before the settings were split by component.
FLAT_BEFORE = {
    "nodes": 5, "topology": "ring", "dataset": "digits", "partition": "shards:2", "model": "lenet",
    "algorithm": "dpsgd", "transport": "udp", "udp_mode": "async", "udp_timeout": 0.7, "chunk_bytes": 4000,
    "missing_chunks": "fill-local", "late_chunks": "drop", "udp_rate_gbps": 1.5, "net": "loss=10%,delay=5ms",
    "loss_mode": "user", "fetch_probability": 0.5, "fetch_timeout": 1.5, "interpolation": "clock",
    "interpolation_value": 0.3, "divergence_threshold": 0.1, "fetch_fresh": False, "slowdown": "0:3", "rounds": 2,
    "batch_size": 8, "lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4, "iterations": 7, "test_after": 3,
    "eval_nodes": 2, "eval_samples": 50, "seed": 4, "wait_timeout": 30.0, "handshake_timeout": 20.0,
    "max_message_mb": 64.0, "host": "127.0.0.1", "base_port": 0, "device": "cpu", "threads": 1, "output": "runs/x",
}


def _check_every_setting(config: ExperimentConfig) -> None:
    assert (config.nodes, config.topology, config.transport, config.rounds, config.momentum) == (5, "ring", "udp", 2, 0.9)
    assert config.udp == UdpSettings(mode="async", timeout=0.7, chunk_bytes=4000, late_chunks="drop", rate_gbps=1.5,
                                     handshake_timeout=20.0, max_message_mb=64.0)
    assert config.tcp == TcpSettings(wait_timeout=30.0, handshake_timeout=20.0, max_message_mb=64.0)
    assert config.dpsgd.missing_chunks == "fill-local"
    assert config.gossip == GossipSettings(fetch_probability=0.5, timeout=1.5, interpolation="clock", value=0.3,
                                           divergence_threshold=0.1, fresh=False)
    assert config.net == NetemSpec(loss=0.1, delay=0.005)


def test_every_flat_setting_of_before_still_loads_into_its_component():
    _check_every_setting(make_config(FLAT_BEFORE))


def test_every_flag_of_before_still_works():
    argv = ["simulate"]
    for name, value in FLAT_BEFORE.items():
        argv += [f"--{name.replace('_', '-')}", str(value).lower() if isinstance(value, bool) else str(value)]
    _check_every_setting(_resolve(build_parser().parse_args(argv)))


def test_sections_and_flat_names_compose_and_the_resolved_config_reads_back(tmp_path):
    nested = make_config({"udp": {"mode": "async"}, "leader": {"weighting": "equal"}, "transport": "udp"})
    assert nested.udp.mode == "async" and nested.leader == LeaderSettings(weighting="equal")
    assert make_config({"udp": {"mode": "async", "timeout": 2}, "udp_mode": "sync"}).udp == UdpSettings(timeout=2)
    config = make_config(FLAT_BEFORE)
    written = yaml.safe_load(config.to_yaml())
    assert written["udp"]["mode"] == "async" and written["net"] == "loss=10%,corr=0%,delay=5ms,jitter=0ms"
    assert make_config(written) == config  # a run's config.yaml is a valid config file


@pytest.mark.parametrize("values, text", [
    ({"udp_mode": "fast"}, "udp_mode 'fast': Input should be 'sync' or 'async'"),
    ({"udp": {"mode": "fast"}}, "udp_mode 'fast'"),
    ({"wait_timeout": -1}, "wait_timeout -1: "),
    ({"batch_sise": 8}, "unknown setting 'batch_sise'"),
    ({"udp": {"speed": 3}}, "unknown setting 'speed'"),
    ({"net": "loss=120%"}, "share like 20%"),
    ({"algorithm": "leader", "transport": "udp"}, "leader exchanges models by request and answer over TCP"),
])
def test_a_bad_setting_is_one_clear_line(values, text):
    with pytest.raises(ConfigError, match=text) as info:
        make_config(values)
    assert "\n" not in str(info.value)


def test_components_validate_their_own_settings_with_one_line():
    with pytest.raises(ConfigError, match="chunk_bytes 7: .*multiple of 8"):
        UdpSettings(chunk_bytes=7)
    with pytest.raises(ConfigError, match="weighting 'loudest'"):
        LeaderSettings(weighting="loudest")
    assert NetemSpec.parse("loss=20%,corr=25%") == NetemSpec(loss=0.2, corr=0.25) == NetemSpec.model_validate(
        {"loss": 0.2, "corr": 0.25})


def test_the_adapter_config_maps_dpwa_names_onto_gossip_settings():
    dpwa = [{"nodes": [{"name": "w1", "host": "localhost", "port": 45000}]}, {"timeout_ms": 800},
            {"constant": {"value": 0.25}}, {"interpolation": "loss"}, {"clock": 0}, {"loss": 0}]
    assert load_gossip_config(dpwa).settings() == GossipSettings(timeout=0.8, value=0.25, interpolation="loss")
    mine = {"nodes": [{"name": "w1", "host": "localhost", "port": 45000}], "gossip": {"timeout": 0.8, "fresh": False}}
    assert load_gossip_config(mine).settings() == GossipSettings(timeout=0.8, fresh=False)
    with pytest.raises(ConfigError, match="timeout_ms "):  # named as the dpwa file names it
        load_gossip_config([{"nodes": [{"name": "w1", "host": "h", "port": 1}]}, {"timeout_ms": -5}])


def test_a_task_spec_composes_gossip_and_leader_settings_and_builds_a_typed_engine_config():
    spec = TaskSpec.parse({
        "task_id": "t1", "model": "mlp", "epochs": 2, "batch_size": 10, "lr": 0.1, "algorithm": "leader",
        "aggregate_every": 4, "seed": 3, "partition": "iid", "eval_samples": 0, "peer_timeout": 7,
        "peers": [{"id": "p0", "address": "a:1"}, {"id": "p1", "address": "b:2"}], "data": {"mode": "local"},
        "leader": {"weighting": "samples"}})
    config = spec.experiment_config(samples=95, host="127.0.0.1", device="cpu", max_message_mb=32)
    assert spec.schedule(95) == (4, 5)  # 10 batches an epoch, 2 epochs, a cycle every 4 batches
    assert (config.algorithm, config.rounds, config.iterations, config.nodes) == ("leader", 4, 5, 2)
    assert config.tcp == TcpSettings(wait_timeout=7, handshake_timeout=21, max_message_mb=32)
    assert config.leader.weighting == "samples" and config.gossip == GossipSettings()
    alone = TaskSpec.parse({**spec.model_dump(), "peers": [{"id": "p0", "address": "a:1"}]})
    assert alone.experiment_config(95, "127.0.0.1", "cpu", 32).algorithm == "local"  # no one to exchange with
    with pytest.raises(BadMessage, match="task spec: leader.weighting 'loudest'"):
        TaskSpec.parse({**spec.model_dump(), "leader": {"weighting": "loudest"}})


def test_the_default_topology_fits_any_node_count_and_a_given_one_is_kept():
    from meshlearn.config import make_config
    from meshlearn.topology import build_topology

    for nodes, expected in ((2, "full"), (3, "full"), (4, "regular:3"), (5, "regular:4"), (8, "regular:3"),
                            (9, "regular:4")):
        config = make_config({"nodes": nodes})
        assert config.topology == expected, nodes
        assert len(build_topology(config.topology, nodes, config.seed).neighbours(0)) >= 1
    assert make_config({"nodes": 5, "topology": "ring"}).topology == "ring"
    again = make_config(make_config({"nodes": 5}).model_dump())  # a resolved config.yaml read back: as it was
    assert again.topology == "regular:4"


def test_simulate_says_when_it_chose_another_topology_than_regular_3(tmp_path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--nodes", "3", "--iterations", "2",
                           "--quiet", "--output", str(tmp_path)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "note: no regular:3 graph has 3 nodes: the topology is full" in done.stderr


# 0.3 MiB is not a whole number of bytes: a trip through bytes and back would give the engine 0.2999992 MiB.
LIMIT_MB, LIMIT_BYTES = 0.3, int(0.3 * 2 ** 20)


@pytest.mark.parametrize("transport", ["tcp", "udp"])
def test_the_message_limit_given_by_its_flat_name_reaches_the_transport_in_bytes_unchanged(transport):
    """``max_message_mb`` (MiB) from an experiment file or ``--max-message-mb``: the transport that
    enforces it gets its bytes, and the resolved config.yaml still writes it in MiB."""
    from torch import nn

    from meshlearn.flat import FlatState
    from meshlearn.node import make_transport

    from_file = make_config({"nodes": 2, "transport": transport, "max_message_mb": LIMIT_MB})
    from_flag = _resolve(build_parser().parse_args(["simulate", "--nodes", "2", "--transport", transport,
                                                    "--max-message-mb", str(LIMIT_MB)]))
    for config in (from_file, from_flag):
        endpoint = make_transport(config, 0, FlatState(nn.Linear(2, 1)))
        assert endpoint.max_message_bytes == LIMIT_BYTES
        assert yaml.safe_load(config.to_yaml())[transport]["max_message_mb"] == LIMIT_MB
        assert make_config(yaml.safe_load(config.to_yaml())) == config


def test_a_providers_message_limit_reaches_its_server_and_its_tasks_engine_in_bytes_unchanged(tmp_path):
    """``meshlearn provider --max-message-mb``: its RPC server, a task's RPCs and the task engine's
    transport all enforce the same bytes; no step turns them back into MiB."""
    from torch import nn

    from meshlearn.cli.flags import given
    from meshlearn.flat import FlatState
    from meshlearn.network.provider.service import Provider, ProviderSettings
    from meshlearn.node import make_transport

    args = build_parser().parse_args(["provider", "--bootstrap", "127.0.0.1:1", "--workdir", str(tmp_path),
                                      "--max-message-mb", str(LIMIT_MB)])
    provider = Provider(ProviderSettings(**given(args, ProviderSettings.model_fields)), b"s" * 32)
    assert provider.server.max_bytes == LIMIT_BYTES
    ctx = provider._task_context()
    assert (ctx.max_message_mb, ctx.max_message_bytes) == (LIMIT_MB, LIMIT_BYTES)
    spec = TaskSpec.parse({
        "task_id": "t1", "model": "mlp", "epochs": 1, "batch_size": 10, "lr": 0.1, "algorithm": "dpsgd",
        "aggregate_every": 4, "seed": 3, "partition": "iid", "eval_samples": 0, "peer_timeout": 7,
        "peers": [{"id": "p0", "address": "a:1"}, {"id": "p1", "address": "b:2"}], "data": {"mode": "local"}})
    config = spec.experiment_config(95, ctx.host, ctx.device, ctx.max_message_mb)
    assert config.tcp.max_message_mb == LIMIT_MB  # as given, not bytes / 2 ** 20
    assert make_transport(config, 0, FlatState(nn.Linear(2, 1))).max_message_bytes == LIMIT_BYTES
