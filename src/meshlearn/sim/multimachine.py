"""One node of an experiment spread over several machines (`meshlearn node`)."""

from __future__ import annotations

from pathlib import Path

import yaml

from meshlearn.config import ExperimentConfig
from meshlearn.errors import ConfigError
from meshlearn.sim.launcher import Say, prepare_run, say_on_stderr
from meshlearn.sim.report import write_report
from meshlearn.transport import Transport


def read_address_file(path: str | Path, config: ExperimentConfig) -> dict[int, tuple[str, int]]:
    """Rank -> (host, port) from a YAML mapping of rank to ``host`` or ``host:port``.

    A bare host listens on ``base_port + rank``.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"address file {path} does not exist: give a YAML file mapping rank -> host:port")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        raise ConfigError(f"address file {path} is not valid YAML: fix its syntax") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"address file {path} must map each rank to host or host:port")
    book: dict[int, tuple[str, int]] = {}
    for key, value in raw.items():
        try:
            rank = int(key)
            host, _, port_text = str(value).rpartition(":") if ":" in str(value) else (str(value), "", "")
            port = int(port_text) if port_text else config.base_port + rank
        except ValueError:
            raise ConfigError(f"address file {path}: entry {key!r}: {value!r} is not host or host:port") from None
        if not port_text and not config.base_port:
            raise ConfigError(f"address file {path}: rank {rank} has no port; write host:port or set base_port")
        if not 1 <= port <= 65535:
            raise ConfigError(f"address file {path}: rank {rank} port {port} is outside 1..65535")
        book[rank] = (host, port)
    missing = sorted(set(range(config.nodes)) - book.keys())
    if missing:
        raise ConfigError(f"address file {path} has no address for rank(s) {missing}: list all {config.nodes} nodes")
    return book


def run_node(config: ExperimentConfig, address_file: str | Path, rank: int, say: Say = say_on_stderr) -> dict:
    """Run node ``rank`` until the experiment ends; write its log and report into the output folder.
    ``say`` hears what it is doing: loading, listening, connecting, and every ``test_after`` iterations."""
    import time

    import torch

    from meshlearn.data.vocabulary import model_metadata
    from meshlearn.models import MODEL_FILE, save_weights
    from meshlearn.node import build_node

    launched = time.monotonic()
    if not 0 <= rank < config.nodes:
        raise ConfigError(f"rank {rank} is outside 0..{config.nodes - 1}")
    book = read_address_file(address_file, config)
    torch.set_num_threads(config.threads)  # this process is the node's, as a launched node's is
    graph, output = prepare_run(config, keep_logs=True, say=lambda text: say(f"node {rank} of {config.nodes}: {text}"))
    host, port = book[rank]
    node = build_node(config, rank, graph, output / "logs", host=host, port=port)
    address = node.transport.bind()
    neighbours = graph.neighbours(rank)
    say(f"node {rank}: listening on {address}; connecting to neighbours {', '.join(map(str, neighbours))}")

    def report_progress(_node, iteration: int, record: dict) -> None:
        done = iteration + 1
        if done == 1:
            say(f"node {rank}: connected and training ({time.monotonic() - launched:.1f} s after start)")
        if done % config.test_after == 0 or done == config.iterations:
            loss = record.get("train_loss")
            say(f"node {rank}: iteration {done}/{config.iterations}"
                + (f", train loss {loss:.4f}" if loss is not None else ""))

    node.hooks.append(report_progress)
    scheme = "udp" if isinstance(node.transport, Transport) and node.transport.lossy else "tcp"
    summary = node.run(node.contacts({j: f"{scheme}://{host}:{port}" for j, (host, port) in book.items()}))
    if rank == 0:  # the run's final model, as a simulation keeps it
        save_weights(node.model.state_dict(), output / MODEL_FILE, model_metadata(node.dataset))
    write_report(output, config.models_module)  # the run its user named
    say(f"node {rank}: finished in {time.monotonic() - launched:.1f} s with start-up; results in {output}")
    return summary
