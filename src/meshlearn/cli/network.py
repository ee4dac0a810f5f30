"""The network commands: bootstrap, provider, request, results, revoke, cluster, leave."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from meshlearn.cli.flags import add_flags, given
from meshlearn.definitions.base import definition
from meshlearn.errors import UserInputError
from meshlearn.network.bootstrap.service import BootstrapSettings
from meshlearn.network.channel.addresses import is_wildcard, reachable_hosts
from meshlearn.network.provider.service import ProviderSettings
from meshlearn.network.task.spec import TaskRequest, udp_rate_mbit
from meshlearn.tblog import require_tensorboard
from meshlearn.training import ALGORITHM_SECTIONS


def _udp_rate(text: str) -> float:
    """``--udp-rate``'s value in Mbit/s, read once here (``10mbit``, ``1gbit``, or Mbit/s): a bad one
    is argparse's one-line error."""
    try:
        return udp_rate_mbit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The request flags; their defaults live in TaskRequest (its training settings, TrainingSettings).
# epochs and batch size are read as numbers, so that a value the rules correct (2.6 epochs) is
# corrected with a warning; the UDP rate as Mbit/s, from the units it is written in.
REQUEST_FLAGS = [name for name in TaskRequest.model_fields
                 if name not in ("data", "data_on_providers", "warnings", "algorithm_settings", *ALGORITHM_SECTIONS)]
# The sections of the algorithms a network task runs, and their flags by flat name (--leader-sync):
# flat -> (section, field)
REQUEST_SECTIONS = {name: TaskRequest.model_fields[name].annotation for name in ALGORITHM_SECTIONS
                    if definition(name).needs.network}
SECTION_FLAGS = {flat: (section, name) for section, cls in REQUEST_SECTIONS.items()
                 for flat, name in cls.flat_names().items()}
REQUEST_TYPES = {"epochs": float, "batch_size": float, "udp_rate": _udp_rate}
PROVIDER_FLAGS = {"ram_gb": "ram", "provider_id": "id"}  # field -> flag, where they differ
# request settings a resumed task may take anew: how it runs, not what it trains (outside its fingerprint)
RESUME_MAY_CHANGE = ("udp_rate",)


def _secret_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--secret", help="network secret, the same on every machine (default: $MESHLEARN_SECRET)")
    parser.add_argument("--secret-file", help="file holding the network secret (default: none, use --secret)")


def _secret(args: argparse.Namespace) -> bytes:
    from meshlearn.network.channel.envelope import resolve_secret

    return resolve_secret(args.secret, args.secret_file)


def _known_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--known-bootstraps", help="file of bootstrap keys trusted on first use (default: "
                        "known_bootstraps in $MESHLEARN_HOME, else ~/.meshlearn)")


def _bootstrap_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", required=True, help="HOST:PORT@KEY of the bootstrap (as it printed at start; "
                        "without @KEY its key is trusted on first use and recorded in --known-bootstraps)")
    _known_flag(parser)


def _identity(path: Path, role: str, say=print):
    """This process's key pair (made on first start), said at start with its fingerprint."""
    from meshlearn.network.channel.identity import load_or_create_key, use_identity

    keys, made = load_or_create_key(path)
    use_identity(keys)
    if say is not None:
        say(f"{role} {keys.describe()}" + (f" (new key pair, kept in {path})" if made else f" (from {path})"))
    return keys


def _requester_key(args: argparse.Namespace) -> Path:
    from meshlearn.network.channel.identity import state_home

    return Path(args.key).expanduser() if args.key else state_home() / "requester.key"


def _pinned_bootstrap(args: argparse.Namespace, secret: bytes, say=print, required: bool = False) -> str:
    from meshlearn.network.channel.pinning import KnownBootstraps, resolve_bootstraps

    return resolve_bootstraps(args.bootstrap, secret, KnownBootstraps(args.known_bootstraps), say, required=required)


_held_keys: list = []  # lock files of key files this process holds (kept open while it runs)


def _hold_key_file(path: Path) -> None:
    """Say so when another provider on this machine already runs with this key file: two providers
    with one key are one participant to the network (its checks, its revocation)."""
    import fcntl

    lock = open(path.with_name(path.name + ".lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"warning: another provider on this machine runs with the key in {path}: the network takes both for one "
              "participant; give each provider its own --workdir (or --key)", flush=True)
    _held_keys.append(lock)


def _port(value: int, what: str = "--port", allow_zero: bool = False) -> int:
    if not (allow_zero and value == 0) and not 1 <= value <= 65535:
        raise UserInputError(f"{what} {value} is outside 1..65535: choose a port in that range")
    return value


def _advertise(host: str) -> str:
    if host and is_wildcard(host):
        raise UserInputError(f"--advertise {host} is not an address others can connect to: give this machine's "
                             "address or name as the other machines see it")
    return host


def _writable_folder(path: Path, flag: str) -> Path:
    """``path`` if it is a folder this process may write into, or one it may make (its nearest
    existing parent such a folder); else UserInputError in one line. Nothing is made here: a check
    before the first network step, whose failure must leave nothing behind."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise UserInputError(f"{flag} {path}: {existing} is a file, not a folder: give a folder path")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserInputError(f"{flag} {path}: cannot write in {existing} (permission denied): give a folder you "
                             "can write")
    return path


def cmd_bootstrap(args: argparse.Namespace) -> int:
    from meshlearn.network.bootstrap.service import Bootstrap
    from meshlearn.transport.ports import ensure_port_free

    settings = BootstrapSettings(**given(args, BootstrapSettings.model_fields))
    _port(settings.port)
    ensure_port_free(settings.host, settings.port)  # before saying anything or creating the state file
    secret = _secret(args)
    settings.relay_port_range()  # a bad range is one line, before anything starts
    settings.registry_location()  # and so is a bad --registry
    keys = _identity(settings.key_file(), "bootstrap", say=None)
    service = Bootstrap(settings, secret, keys)
    page = _dashboard_of(settings, secret, service.board)
    signal.signal(signal.SIGTERM, lambda *_: service.stop())
    print(f"bootstrap on {settings.host}:{settings.port}, registry {service.registry.store.describe()}, heartbeat TTL "
          f"{settings.ttl:g} s", flush=True)
    print(f"bootstrap {keys.describe()} (key pair in {settings.key_file()})", flush=True)
    hosts = [f"{host}:{settings.port}" for host in reachable_hosts()] if is_wildcard(settings.host) \
        else [f"{settings.public_host()}:{settings.port}"]
    if settings.advertise:
        hosts = [f"{settings.advertise}:{settings.port}"]
    ready = threading.Event()

    def say_where():
        if ready.wait(60):
            print(f"relay on port {service.relay.port} (participants behind NAT reach the network through it)",
                  flush=True)
            print(f"other machines give --bootstrap {hosts[0]}@{keys.text}"
                  + (f" (or {', '.join(hosts[1:])} with the same @KEY)" if hosts[1:] else "")
                  + (" (listening on every interface)" if is_wildcard(settings.host) else ""), flush=True)
    threading.Thread(target=say_where, daemon=True).start()
    try:
        if page is not None:
            print(f"dashboard: {page.start()}", flush=True)
        service.run(ready)
    except KeyboardInterrupt:
        pass
    finally:
        if page is not None:
            page.stop()
    print("bootstrap stopped; the registry is kept in " + service.registry.store.describe(), flush=True)
    return 0


def _dashboard_of(settings: BootstrapSettings, secret: bytes, source):
    """The bootstrap's page (not started: its start binds, and a taken port is one line), or None
    without --dashboard."""
    if not settings.dashboard:
        return None
    from meshlearn.dashboard.access import token_from_secret
    from meshlearn.dashboard.server import DashboardServer, parse_listen

    host, port = parse_listen(settings.dashboard)
    return DashboardServer(source, host, port, token=settings.dashboard_token or token_from_secret(secret))


def cmd_provider(args: argparse.Namespace) -> int:
    from meshlearn.network.provider.service import Provider
    from meshlearn.network.provider.testhooks import TestHooks

    values = given(args, ProviderSettings.model_fields)
    values["bootstrap"] = args.bootstrap
    settings = ProviderSettings(**values)
    _port(settings.port, allow_zero=True)
    _advertise(settings.advertise)
    if settings.device not in ("auto", "cpu", "cuda", "mps") and not settings.device.startswith("cuda:"):
        raise UserInputError(f"--device {settings.device!r} is not auto, cpu, cuda, cuda:N or mps")
    if settings.data_root and not Path(settings.data_root).is_dir():
        raise UserInputError(f"--data-root {settings.data_root} is not a folder")
    if settings.workdir:
        _writable_folder(Path(settings.workdir).expanduser(), "--workdir")
    secret = _secret(args)
    hooks = TestHooks.from_environment()  # read once, here: a bad test switch is one line too
    _check_declared(settings)
    _load_models_module(settings.models_module)  # a broken module is one line before the bootstrap is asked anything
    keys = _identity(settings.key_file(), "provider")
    _hold_key_file(settings.key_file())
    settings = settings.model_copy(update={"bootstrap": _pinned_bootstrap(args, secret)})
    provider = Provider(settings, secret, keys, hooks=hooks)

    def interrupted(signum, frame):
        if provider.leaving.is_set():
            print("second interrupt: stopping now", flush=True)
            provider.stop()
        else:
            provider.leave()

    def terminated(signum, frame):  # a process manager's stop: now, whatever the task's state
        print(f"provider {provider.id}: stopping (SIGTERM)", flush=True)
        provider.stop()
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGTERM, terminated)
    provider.run()
    return 0


def _check_declared(settings: ProviderSettings) -> None:
    """What the provider declares, against this machine: more than it has is one line, less than
    ML's minimum a warning (network.task.resources.check_declared)."""
    from meshlearn.network.channel.identity import state_home
    from meshlearn.network.task.resources import check_declared

    for warning in check_declared(settings.ram_gb, settings.cores, Path(settings.workdir or state_home())):
        print(f"warning: {warning}", flush=True)


def cmd_leave(args: argparse.Namespace) -> int:
    from meshlearn.errors import KeyMismatch, RemoteError, Unreachable
    from meshlearn.network.channel.identity import (
        key_text,
        load_or_create_key,
        pinned,
        split_pinned,
        use_identity,
    )
    from meshlearn.network.channel.rpc import parse_address
    from meshlearn.network.protocol.message import Empty
    from meshlearn.network.protocol.rpcs import PROVIDER_LEAVE
    from meshlearn.network.protocol.serving import ask

    address, key = split_pinned(args.provider)
    address = parse_address(address, "--provider")
    path = ProviderSettings(bootstrap="-", key=args.key or "", workdir=args.workdir or "").key_file()
    if not path.is_file():  # only the provider's own key may make it leave
        raise UserInputError(f"no provider key file {path}: run this where the provider runs, with the --workdir "
                             "(or --key) it was started with")
    keys, _ = load_or_create_key(path)
    use_identity(keys)
    if key is not None and key != keys.public:
        raise UserInputError(f"--provider pins key {key_text(key)}, but {path} holds {keys.text}: give the --workdir "
                             "(or --key) of that provider")
    try:
        reply = ask(pinned(address, keys.public), PROVIDER_LEAVE, Empty(), _secret(args), timeout=10)
    except KeyMismatch:
        raise UserInputError(f"the provider at {address} does not hold the key in {path} ({keys.text}): give the "
                             "--workdir (or --key) that provider was started with") from None
    except Unreachable:
        raise UserInputError(f"no provider answers at {address}: check --provider") from None
    except RemoteError as exc:
        raise UserInputError(f"the provider at {address} refused: {exc}") from None
    after = reply.after_task
    print("provider is leaving" + (f" after task {after} finishes" if after else " now"))
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    from meshlearn.network.bootstrap.registry import Registry
    from meshlearn.network.channel.identity import key_from_text, key_text

    key = key_text(key_from_text(args.key, "KEY"))
    where = BootstrapSettings(state=args.state, registry=args.registry or "",
                              registry_tls=args.registry_tls or "").registry_location()
    if isinstance(where, Path) and not where.is_file():
        raise UserInputError(f"--state {args.state} does not exist: give the registry file of the bootstrap "
                             "(its --state), or its etcd cluster (--registry)")
    registry = Registry(where).open()
    try:
        gone = registry.revoke(key)
    finally:
        registry.close()
    print(f"key {key} revoked: {'every bootstrap' if args.registry else 'the bootstrap'} refuses its new "
          "connections from now on"
          + (f"; provider(s) {', '.join(gone)} removed from the registry" if gone else ""))
    return 0


def _request_values(args: argparse.Namespace) -> dict:
    from meshlearn.config import read_config_file

    values = read_config_file(args.config) if args.config else {}
    values.update(given(args, REQUEST_FLAGS))
    for flat, value in given(args, SECTION_FLAGS).items():
        section, name = SECTION_FLAGS[flat]
        values[section] = {**(values.get(section) or {}), name: value}
    values["data"] = args.data or values.get("data")
    if args.data_on_providers:
        values["data_on_providers"] = args.data_on_providers
    return values


def cmd_request(args: argparse.Namespace) -> int:
    import datetime

    from meshlearn.network.channel.identity import split_pinned
    from meshlearn.network.channel.rpc import parse_address
    from meshlearn.network.requester.results import summary_line
    from meshlearn.network.requester.service import Requester
    from meshlearn.network.task.spec import validate_request

    _port(args.port, allow_zero=True)
    if args.tensorboard:
        require_tensorboard()
        _writable_folder(Path(args.tensorboard), "--tensorboard")
    _advertise(args.advertise)
    for part in args.bootstrap.split(","):  # a typo is one line before any work
        parse_address(split_pinned(part.strip())[0], "--bootstrap")
    secret = _secret(args)
    if args.resume:
        return _resume_task(args, secret)
    values = _request_values(args)
    _load_models_module(args.models_module)  # before the data: the module may register the dataset too
    _check_model(validate_request(values), None)  # what needs no data is checked first (a second) ...
    dataset = None
    if values.get("data") and not values.get("data_on_providers"):  # ... then the data, read here ...
        dataset = _load_data(str(values["data"]), int(values.get("context") or 128),
                             values.get("vocabulary") or "bytes")
    request = validate_request(values, len(dataset.train_y) if dataset is not None else None)
    _check_model(request, dataset)  # ... the model on it and the weights ...
    output = _writable_folder(Path(args.output or f"runs/task-{datetime.datetime.now():%Y%m%d-%H%M%S}"), "--output")
    keys = _identity(_requester_key(args), "requester")
    bootstrap = _pinned_bootstrap(args, secret, required=True)  # ... and only then the first network step
    requester = Requester(request, bootstrap, secret, output, args.host, args.port, dataset=dataset,
                          advertise=args.advertise, keys=keys, tensorboard=args.tensorboard)
    metrics = requester.run()
    print(f"task {requester.task_id} done: {summary_line(metrics)}")
    figures = "confusion.png" + (", predictions.png" if (output / "predictions.png").is_file() else "")
    print(f"results: {output}  (model.safetensors, metrics.json, {figures}, task.yaml)")
    return 0


def _resume_task(args: argparse.Namespace, secret: bytes) -> int:
    """``request --resume TASK_ID``: the task goes on from the checkpoints its requester kept, with
    its own settings, on as many providers as it had (its own first, where they came back)."""
    from meshlearn.errors import CheckpointError
    from meshlearn.network.requester.results import summary_line
    from meshlearn.network.requester.service import Requester
    from meshlearn.network.task.state import (
        KeptCheckpoints,
        TaskRecord,
        find_task,
        secret_digest,
    )

    folder = find_task(args.resume, args.output)
    record = TaskRecord.read(folder)
    if record.task_id != args.resume:
        raise CheckpointError(f"{folder} holds task {record.task_id}, not {args.resume}")
    if record.secret != secret_digest(secret, record.task_id):
        raise CheckpointError(f"task {record.task_id} ran on a network with another secret: give that network's "
                              "--secret or --secret-file")
    if record.status == "done":
        raise CheckpointError(f"task {record.task_id} is done: its result is in {folder}")
    changes = {name: value for name, value in _request_values(args).items() if value is not None}
    saved = record.request.model_dump()
    differ = sorted(name for name, value in changes.items()
                    if name not in ("data", *RESUME_MAY_CHANGE) and saved.get(name) != value)
    if differ or (args.data and args.data != record.request.data):
        raise CheckpointError("--resume goes on with the task's own settings; these differ from them: "
                              + ", ".join(differ or ["data"]) + " (leave them out, or request a new task)")
    count = len(record.providers or [])
    kept = KeptCheckpoints(folder)
    from meshlearn.definitions.base import definition

    in_step = definition(record.request.algorithm).needs.synchronous or record.request.leader.sync
    cycles = kept.resume_cycles(count, in_step) if count else None
    if cycles is None:
        raise CheckpointError(f"task {record.task_id} has no checkpoint from every one of its providers in {folder}: "
                              "request it afresh")
    kept.check(cycles, record.fingerprint)
    request = record.request.model_copy(update={"providers": count, **{name: changes[name] for name in RESUME_MAY_CHANGE
                                                                        if name in changes}})
    _load_models_module(args.models_module)
    dataset = None
    if request.data and not request.data_on_providers:
        dataset = _load_data(request.data, request.context, request.vocabulary)
    keys = _identity(_requester_key(args), "requester")
    bootstrap = _pinned_bootstrap(args, secret, required=True)  # every local check done: the first network step
    said = f"cycle {cycles[0]}" if len(set(cycles)) == 1 else "cycles " + ", ".join(map(str, cycles))
    print(f"task {record.task_id}: resuming from its providers' checkpoints of {said}", file=sys.stderr)
    requester = Requester(request, bootstrap, secret, folder, args.host, args.port, dataset=dataset,
                          advertise=args.advertise, keys=keys, tensorboard=args.tensorboard,
                          record=record, resume=cycles)
    metrics = requester.run()
    print(f"task {requester.task_id} done: {summary_line(metrics)}")
    print(f"results: {folder}  (model.safetensors, metrics.json, task.yaml)")
    return 0


def _load_models_module(path: str | None) -> None:
    """Load the user's module of models (and datasets) the task names, if one is given: a broken
    one is one line."""
    if path:
        from meshlearn.plugins import load_user_module

        load_user_module(path)


def _load_data(data: str, context: int, vocabulary: str):
    """The dataset ``--data`` names, read here before any network step: a path that holds no
    dataset is one line before the bootstrap is asked anything."""
    from meshlearn.data import load_dataset
    from meshlearn.network.task.spec import dataset_spec

    return load_dataset(dataset_spec(data), context=context, vocabulary=vocabulary)


def _check_model(request, dataset) -> None:
    """The model is one this requester knows, and the weights fit it, before any provider is claimed."""
    from meshlearn.models import build_model, load_weights, model_names

    if request.model not in model_names():
        raise UserInputError(f"unknown model {request.model!r}: choose one of {', '.join(model_names())} (a custom "
                             "model needs its module here too: --models-module FILE)")
    if dataset is not None:
        model = build_model(request.model, dataset.input_shape, dataset.num_classes)
        if request.weights:
            load_weights(model, request.weights)


def cmd_results(args: argparse.Namespace) -> int:
    from meshlearn.network.requester.results import results_of_task, summary_line

    output = _writable_folder(Path(args.output or f"runs/task-{args.task_id}"), "--output")
    secret = _secret(args)
    _identity(_requester_key(args), "requester", say=None)
    metrics = results_of_task(args.task_id, _pinned_bootstrap(args, secret, required=True), secret, output)
    print(f"task {args.task_id}: {summary_line(metrics)} (from {metrics['fetched_from']})")
    print(f"results: {output}")
    return 0


def add_network_commands(sub) -> None:
    """Add bootstrap, provider, request, results, revoke, cluster and leave to the `meshlearn` parser."""
    _add_bootstrap(sub)
    _add_provider(sub)
    _add_request(sub)
    _add_results(sub)
    _add_revoke(sub)
    _add_cluster(sub)
    _add_leave(sub)


def _add_bootstrap(sub) -> None:
    """Add the ``bootstrap`` command: the network's entry point and provider registry."""
    boot = sub.add_parser("bootstrap", help="run the network's entry point and provider registry")
    add_flags(boot, [(n, f) for n, f in BootstrapSettings.model_fields.items() if n != "max_request_bytes"])
    _secret_flags(boot)
    boot.set_defaults(func=cmd_bootstrap)


def _add_provider(sub) -> None:
    """Add the ``provider`` command: lend this machine to the network."""
    prov = sub.add_parser("provider", help="lend this machine to the network")
    _bootstrap_flag(prov)
    add_flags(prov, [(n, f) for n, f in ProviderSettings.model_fields.items() if n != "bootstrap"],
              flag_names=PROVIDER_FLAGS)
    _secret_flags(prov)
    prov.set_defaults(func=cmd_provider)


def _add_request(sub) -> None:
    """Add the ``request`` command: a training task, its data and its settings."""
    req = sub.add_parser("request", help="train a model on the network's providers")
    _bootstrap_flag(req)
    req.add_argument("--key", help="file of this requester's key pair, made on first use (default: requester.key "
                     "in $MESHLEARN_HOME, else ~/.meshlearn)")
    req.add_argument("--data", help="folder with train/ and test/, or a dataset (digits, cifar10:PATH, ...) "
                     "(default: none; this or --data-on-providers)")
    req.add_argument("--data-on-providers", help="dataset each provider already holds, under its --data-root "
                     "(default: none, the requester serves --data)")
    req.add_argument("--config", help="YAML task file; flags override it (default: none)")
    req.add_argument("--output", help="results folder (default: runs/task-<time>)")
    req.add_argument("--resume", metavar="TASK_ID", help="go on with a task whose processes all stopped, from the "
                     "checkpoints its providers sent (its results folder: --output, or the one under runs/ that "
                     "holds it) (default: a new task)")
    req.add_argument("--host", default="127.0.0.1",
                     help="address to serve the data on, 0.0.0.0 for all (default: 127.0.0.1)")
    req.add_argument("--port", type=int, default=0, help="port to serve the data on (default: 0, a free one)")
    req.add_argument("--advertise", default="", help="address providers fetch the data from (default: --host; "
                     "with 0.0.0.0, this machine's address on the route to the bootstrap)")
    req.add_argument("--models-module", help="local .py file registering the custom model (or dataset) the task names "
                     "(default: none)")
    req.add_argument("--tensorboard", metavar="DIR", default="", help="write TensorBoard event files of the task "
                     "(each provider's train loss and test accuracy as they come, the result) under DIR/task-ID "
                     "(default: none)")
    add_flags(req, [(name, TaskRequest.model_fields[name]) for name in REQUEST_FLAGS], types_=REQUEST_TYPES)
    add_flags(req, [(flat, REQUEST_SECTIONS[section].model_fields[name])
                    for flat, (section, name) in SECTION_FLAGS.items()])
    _secret_flags(req)
    req.set_defaults(func=cmd_request)


def _add_results(sub) -> None:
    """Add the ``results`` command: fetch a finished task's model and metrics."""
    res = sub.add_parser("results", help="fetch a finished task's model and metrics")
    res.add_argument("task_id", help="the id `meshlearn request` printed")
    _bootstrap_flag(res)
    res.add_argument("--key", help="file of this requester's key pair (default: requester.key in $MESHLEARN_HOME, "
                     "else ~/.meshlearn)")
    res.add_argument("--output", help="folder to write into (default: runs/task-<id>)")
    _secret_flags(res)
    res.set_defaults(func=cmd_results)


def _add_cluster(sub) -> None:
    """Add the ``cluster`` command: several bootstraps sharing one registry, on this machine, to try it."""
    cluster = sub.add_parser("cluster", help="run 3 bootstraps sharing one registry (an etcd cluster) on this "
                             "machine: a network without a single point of failure, to try")
    cluster.add_argument("--size", type=int, default=3, help="bootstraps, each with an etcd member (default: 3)")
    cluster.add_argument("--folder", default="meshlearn-cluster", help="where the members' data, the TLS files and "
                         "the logs go (default: meshlearn-cluster)")
    cluster.add_argument("--host", default="127.0.0.1", help="address everything listens on (default: 127.0.0.1)")
    cluster.add_argument("--port", type=int, default=8080, help="the first bootstrap's port; the others follow, two "
                         "apart (each relay on the port after its bootstrap's) (default: 8080)")
    cluster.add_argument("--etcd-port", type=int, default=2379, help="the first etcd member's client port; each "
                         "member's peer port is the one after, the next member two on (default: 2379)")
    _secret_flags(cluster)
    cluster.set_defaults(func=cmd_cluster)


def cmd_cluster(args: argparse.Namespace) -> int:
    from meshlearn.network.bootstrap.cluster import LocalCluster
    from meshlearn.network.bootstrap.etcdcluster import etcd_binary, missing_etcd_message

    if etcd_binary() is None:
        raise UserInputError(missing_etcd_message())
    for port in (args.port, args.etcd_port):
        _port(port)
    secret = _secret(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    cluster = LocalCluster(Path(args.folder), args.size, args.host, args.port, args.etcd_port, secret,
                           say=lambda line: print(line, flush=True))
    try:
        cluster.run(stop)
    except KeyboardInterrupt:
        pass
    print("cluster stopped; its registry is kept in " + str(Path(args.folder)), flush=True)
    return 0


def _add_revoke(sub) -> None:
    """Add the ``revoke`` command: shut a key out of the bootstrap's registry."""
    revoke = sub.add_parser("revoke", help="shut a participant's key out of the network (run where the bootstrap "
                            "keeps its registry)")
    revoke.add_argument("key", metavar="KEY", help="the public key to refuse, as the participant printed it")
    revoke.add_argument("--state", default=BootstrapSettings.model_fields["state"].default,
                        help="the bootstrap's registry file (default: meshlearn-bootstrap.sqlite)")
    revoke.add_argument("--registry", help="etcd://HOST:PORT[,HOST:PORT...]: the etcd cluster a network of several "
                        "bootstraps keeps its registry in; every one of them refuses the key (default: --state)")
    revoke.add_argument("--registry-tls", help="folder of the etcd cluster's certificates (ca.crt, client.crt, "
                        "client.key) (default: none, plain HTTP)")
    revoke.set_defaults(func=cmd_revoke)


def _add_leave(sub) -> None:
    """Add the ``leave`` command: ask a provider to leave after its task."""
    leave = sub.add_parser("leave", help="ask a provider to leave the network after its current task")
    leave.add_argument("--provider", required=True, help="HOST:PORT of the provider, run where it runs: only its "
                       "own key (from its --workdir or --key) may make it leave")
    leave.add_argument("--key", help="the provider's key file, if it was started with --key "
                       "(default: as the provider chose it)")
    leave.add_argument("--workdir", help="the provider's --workdir, if it was started with one (default: none)")
    _secret_flags(leave)
    leave.set_defaults(func=cmd_leave)
