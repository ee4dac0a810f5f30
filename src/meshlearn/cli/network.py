"""The network commands: bootstrap, provider, request, results, leave."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from meshlearn.errors import UserInputError

REQUEST_FLAGS = {  # flag -> (type, help); defaults live in network.task.TaskRequest
    "model": (str, "built-in model name (default simplecnn)"),
    "epochs": (float, "epochs over each provider's partition (default 10)"),
    "batch_size": (float, "mini-batch size (default 16)"),
    "lr": (float, "learning rate (default 0.01)"),
    "momentum": (float, "SGD momentum in [0, 1) (default 0)"),
    "providers": (int, "providers to train on (default 4)"),
    "device": (str, "preferred device: any | gpu | mps | cpu (default any)"),
    "location": (str, "only providers declaring this location"),
    "algorithm": (str, "leader | dpsgd | gossip (default leader)"),
    "aggregate_every": (str, "aggregate every N batches, or 'epoch' (default epoch)"),
    "seed": (int, "seed of partitions and initial model (default 90)"),
    "partition": (str, "iid | shards:K | dirichlet:ALPHA (default iid)"),
    "eval_samples": (int, "evaluate on the first N test samples only (default all)"),
    "peer_timeout": (float, "seconds of silence before a provider counts as gone (default 20)"),
    "weights": (str, "safetensors file of initial weights for the model (default: a fresh model from --seed)"),
}


def _secret_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--secret", help="network secret (or set MESHLEARN_SECRET; same on every machine)")
    parser.add_argument("--secret-file", help="file holding the network secret")


def _secret(args: argparse.Namespace) -> bytes:
    from meshlearn.network.envelope import resolve_secret

    return resolve_secret(args.secret, args.secret_file)


def _port(value: int, what: str = "--port", allow_zero: bool = False) -> int:
    if not (allow_zero and value == 0) and not 1 <= value <= 65535:
        raise UserInputError(f"{what} {value} is outside 1..65535: choose a port in that range")
    return value


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from meshlearn.network.bootstrap import Bootstrap, BootstrapSettings

    if args.ttl <= 0:
        raise UserInputError("--ttl must be more than 0 seconds")
    service = Bootstrap(BootstrapSettings(args.host, _port(args.port), args.state, args.ttl), _secret(args))
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    print(f"bootstrap on {args.host}:{args.port}, registry {args.state}, heartbeat TTL {args.ttl:g} s", flush=True)
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    print("bootstrap stopped; the registry is kept in " + args.state, flush=True)
    return 0


def cmd_provider(args: argparse.Namespace) -> int:
    from meshlearn.network.provider import Provider, ProviderSettings
    from meshlearn.network.rpc import parse_address

    if args.device not in ("auto", "cpu", "cuda", "mps") and not args.device.startswith("cuda:"):
        raise UserInputError(f"--device {args.device!r} is not auto, cpu, cuda, cuda:N or mps")
    if args.data_root and not Path(args.data_root).is_dir():
        raise UserInputError(f"--data-root {args.data_root} is not a folder")
    settings = ProviderSettings(
        bootstrap=parse_address(args.bootstrap, "--bootstrap"), host=args.host, port=_port(args.port, allow_zero=True),
        location=args.location or "", ram_gb=args.ram, cores=args.cores, device=args.device,
        workdir=args.workdir or "", data_root=args.data_root, models_module=args.models_module,
        provider_id=args.id or "")
    provider = Provider(settings, _secret(args))

    def interrupted(signum, frame):
        if provider.leaving.is_set():
            print("second interrupt: stopping now", flush=True)
            provider.stop()
        else:
            provider.leave()
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, interrupted)
    provider.run()
    return 0


def cmd_leave(args: argparse.Namespace) -> int:
    from meshlearn.network.rpc import call, parse_address

    reply = call(parse_address(args.provider, "--provider"), "provider.leave", {}, _secret(args), timeout=10)
    after = reply.body.get("after_task")
    print("provider is leaving" + (f" after task {after} finishes" if after else " now"))
    return 0


def _request_values(args: argparse.Namespace) -> dict:
    from meshlearn.config import read_config_file

    values = read_config_file(args.config) if args.config else {}
    for name in REQUEST_FLAGS:
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    values["data"] = args.data or values.get("data")
    if args.data_on_providers:
        values["data_on_providers"] = args.data_on_providers
    return values


def cmd_request(args: argparse.Namespace) -> int:
    import datetime

    from meshlearn.network.requester import Requester, summary_line
    from meshlearn.network.rpc import parse_address
    from meshlearn.network.task import dataset_spec, validate_request

    bootstrap = parse_address(args.bootstrap, "--bootstrap")
    _port(args.port, allow_zero=True)
    secret = _secret(args)
    values = _request_values(args)
    dataset = None
    if values.get("data") and not values.get("data_on_providers"):
        from meshlearn.data import load_dataset

        dataset = load_dataset(dataset_spec(str(values["data"])))
    request = validate_request(values, len(dataset.train_y) if dataset is not None else None)
    output = Path(args.output or f"runs/task-{datetime.datetime.now():%Y%m%d-%H%M%S}")
    requester = Requester(request, bootstrap, secret, output, args.host, args.port, dataset=dataset)
    metrics = requester.run()
    print(f"task {requester.task_id} done: {summary_line(metrics)}")
    print(f"results: {output}  (model.safetensors, metrics.json, confusion.png, task.yaml)")
    return 0


def cmd_results(args: argparse.Namespace) -> int:
    from meshlearn.network.requester import results_of_task, summary_line
    from meshlearn.network.rpc import parse_address

    output = Path(args.output or f"runs/task-{args.task_id}")
    metrics = results_of_task(args.task_id, parse_address(args.bootstrap, "--bootstrap"), _secret(args), output)
    print(f"task {args.task_id}: {summary_line(metrics)} (from {metrics['fetched_from']})")
    print(f"results: {output}")
    return 0


def add_network_commands(sub) -> None:
    """Add bootstrap, provider, request, results and leave to the `meshlearn` parser."""
    boot = sub.add_parser("bootstrap", help="run the network's entry point and provider registry")
    boot.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all)")
    boot.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    boot.add_argument("--state", default="meshlearn-bootstrap.sqlite", help="SQLite file of the registry")
    boot.add_argument("--ttl", type=float, default=30.0, help="seconds without a heartbeat before a provider is dropped")
    _secret_flags(boot)
    boot.set_defaults(func=cmd_bootstrap)

    prov = sub.add_parser("provider", help="lend this machine to the network")
    prov.add_argument("--bootstrap", required=True, help="HOST:PORT of the bootstrap")
    prov.add_argument("--host", default="127.0.0.1", help="address to listen on and announce")
    prov.add_argument("--port", type=int, default=0, help="port to listen on (in use or 0: a free one)")
    prov.add_argument("--location", help="where this machine is (requesters may filter on it)")
    prov.add_argument("--ram", type=float, help="GB of RAM to declare (default: detected)")
    prov.add_argument("--cores", type=int, help="cores to declare (default: detected)")
    prov.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N | mps (falls back to cpu)")
    prov.add_argument("--id", help="provider id (default: host name and a random suffix)")
    prov.add_argument("--workdir", help="where tasks' data and results are kept")
    prov.add_argument("--data-root", help="folder whose datasets tasks may name with --data-on-providers")
    prov.add_argument("--models-module", help="local .py file registering custom models (never from the network)")
    _secret_flags(prov)
    prov.set_defaults(func=cmd_provider)

    req = sub.add_parser("request", help="train a model on the network's providers")
    req.add_argument("--bootstrap", required=True, help="HOST:PORT of the bootstrap")
    req.add_argument("--data", help="folder with train/ and test/, or a dataset (digits, cifar10:PATH, ...)")
    req.add_argument("--data-on-providers", help="dataset each provider already holds, under its --data-root")
    req.add_argument("--config", help="YAML task file; flags override it")
    req.add_argument("--output", help="results folder (default runs/task-<time>)")
    req.add_argument("--host", default="127.0.0.1", help="address providers fetch the data from")
    req.add_argument("--port", type=int, default=0, help="port to serve the data on (0: a free one)")
    for name, (kind, text) in REQUEST_FLAGS.items():
        req.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=None, help=text)
    _secret_flags(req)
    req.set_defaults(func=cmd_request)

    res = sub.add_parser("results", help="fetch a finished task's model and metrics")
    res.add_argument("task_id", help="the id `meshlearn request` printed")
    res.add_argument("--bootstrap", required=True, help="HOST:PORT of the bootstrap")
    res.add_argument("--output", help="folder to write into (default runs/task-<id>)")
    _secret_flags(res)
    res.set_defaults(func=cmd_results)

    leave = sub.add_parser("leave", help="ask a provider to leave the network after its current task")
    leave.add_argument("--provider", required=True, help="HOST:PORT of the provider")
    _secret_flags(leave)
    leave.set_defaults(func=cmd_leave)
