"""The `meshlearn` command: demo, simulate, experiment, node, and the network commands (cli.network)."""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.metadata
import json
import logging
import sys
import time
import typing
from pathlib import Path
from typing import Any, Sequence

from meshlearn.cli import COMMAND_STARTED
from meshlearn.cli.flags import add_flags, as_typed, brief, given
from meshlearn.cli.live import add_live_flags, check_live_flags, dashboard, watch_run
from meshlearn.cli.network import add_network_commands
from meshlearn.config import (
    DEFAULT_TOPOLOGY,
    FLAT_ROUTES,
    ExperimentConfig,
    flat_fields,
    make_config,
    read_config_file,
)
from meshlearn.definitions.base import DEFINITIONS
from meshlearn.errors import MeshlearnError, about
from meshlearn.exiting import exit_now
from meshlearn.plugins import load_user_module
from meshlearn.suggest import closest, did_you_mean
from meshlearn.training import user_settings_class

DEMO = {
    "nodes": 8,
    "topology": "regular:3",
    "dataset": "digits",
    "partition": "iid",
    "model": "mlp",
    "rounds": 2,
    "batch_size": 16,
    "lr": 0.05,
    "iterations": 200,
    "test_after": 20,
    "output": "runs/demo",
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag or value as one line (exit 2) instead of usage plus error,
    suggests the flag, command or choice a typo meant (``suggest.closest``), takes no abbreviations
    (``--node 4`` is not ``--nodes 4``), and keeps its usage to one line. A command given its
    ``common`` flags (``show_common``) lists only those with --help, and every one with --help-all."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.common: dict[str, list[str]] = {}

    def show_common(self, groups: dict[str, list[str]]) -> None:
        """--help lists only these flags (group title -> flag destinations) and says how to see the
        rest; --help-all lists every flag. Their order also ranks suggestions for a mistyped flag."""
        self.common = groups
        self.add_argument("--help-all", action=_HelpAll, help="show every flag, not only the common ones, and exit")

    @property
    def usage(self) -> str | None:
        """The usage line: the one given, else ``_short_usage``."""
        return self._usage or self._short_usage()

    @usage.setter
    def usage(self, value: str | None) -> None:
        self._usage = value

    def format_help(self) -> str:
        if not self.common:
            return super().format_help()
        formatter = self._get_formatter()
        formatter.add_usage(self.usage, self._actions, self._mutually_exclusive_groups)
        formatter.add_text(self.description)
        by_dest = {action.dest: action for action in self._actions}
        for title, dests in self.common.items():
            formatter.start_section(title)
            formatter.add_arguments([_briefly(by_dest[dest]) for dest in dests])
            formatter.end_section()
        shown = {dest for dests in self.common.values() for dest in dests}
        rest = [action for action in self._actions if action.option_strings and action.dest not in shown
                and not isinstance(action, (argparse._HelpAction, _HelpAll))]
        formatter.add_text(f"These are the common flags: {self.prog} --help-all lists every one ({len(rest)} more: "
                           "each algorithm's and transport's settings, privacy, attacks, checkpoints, ...), as "
                           "does docs/settings.md.")
        return formatter.format_help()

    def format_help_all(self) -> str:
        """The help of every flag, by group."""
        return super().format_help()

    def _short_usage(self) -> str | None:
        """A command's synopsis in one line, ``meshlearn node --config CONFIG ... [options]``: what it
        requires, then ``[options]`` for the flags its help lists (argparse's lists every flag)."""
        if self._subparsers is not None:  # `meshlearn` itself: argparse's is short
            return None
        words = [f"{action.option_strings[-1]} {action.metavar or action.dest.upper()}" if action.option_strings
                 else str(action.metavar or action.dest) for action in self._actions
                 if action.required or not action.option_strings]
        return " ".join(["%(prog)s", *words, "[options]"])

    def error(self, message: str) -> typing.NoReturn:
        hint = f"see {self.prog} {'--help-all' if self.common else '--help'}"
        if message.startswith("unrecognized arguments") and {"-v", "--verbose"} & set(message.split()):
            hint = "-v goes before the command: meshlearn -v COMMAND ..."
        elif message.startswith("unrecognized arguments"):
            hint = self._did_you_mean(message.partition(":")[2].split()) or hint
        elif "required: KEY" in message:  # a printed key may start with '-', which argparse takes for a flag
            hint = f"a KEY that starts with '-' goes after '--': {self.prog} -- KEY"
        elif CHOICES in message:  # the choices are listed: nothing to look up
            self.exit(2, f"{self.prog}: error: {message}\n")
        self.exit(2, f"{self.prog}: error: {message} ({hint})\n")

    def _did_you_mean(self, words: list[str]) -> str:
        """"did you mean --iterations? ..." for the first unknown flag that is close to one of this
        command's (the common ones first); a flag given a value is answered only with flags that take
        one (``--epochs 3`` is never ``--full-epochs``, a yes/no flag)."""
        for index, word in enumerate(words):
            flag, eq, value = word.partition("=")
            if not flag.startswith("--"):
                continue
            if not eq and index + 1 < len(words) and not _looks_like_flag(words[index + 1]):
                value = words[index + 1]
            given = bool(eq) or bool(value)
            found = closest(flag, [option for action in self._by_likelihood() if not given or _takes(action, value)
                                   for option in action.option_strings if option.startswith("--")])
            if found:
                return f"did you mean {found}? see {self.prog} {self._help_showing(found)}"
        return ""

    def _help_showing(self, flag: str) -> str:
        """The help flag whose list holds ``flag``: --help, or --help-all for one it leaves out."""
        dest = self._option_string_actions[flag].dest
        return "--help" if not self.common or any(dest in dests for dests in self.common.values()) else "--help-all"

    def _by_likelihood(self) -> list[argparse.Action]:
        """This command's flags, the common ones first."""
        common = [dest for dests in self.common.values() for dest in dests]
        rank = {dest: order for order, dest in enumerate(common)}
        return sorted((a for a in self._actions if a.option_strings), key=lambda a: rank.get(a.dest, len(rank)))

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value not among a flag's (or the commands') choices: which it may have meant, and all."""
        if action.choices is None or value in action.choices:
            return
        choices = [str(choice) for choice in action.choices]
        hint = did_you_mean(str(value), choices)
        what = f"{action.option_strings[-1]} {value}:" if action.option_strings else f"{value!r} is not a command:"
        raise argparse.ArgumentError(None, f"{what} {hint}{CHOICES} {', '.join(choices)}")

    def _get_value(self, action: argparse.Action, text: str) -> Any:
        """A flag's value of its type, or one line naming the flag and the value typed."""
        try:
            return super()._get_value(action, text)
        except argparse.ArgumentError:
            if not action.option_strings or action.type not in (int, float):
                raise
            kind = "a whole number" if action.type is int else "a number"
            raise argparse.ArgumentError(None, f"{action.option_strings[-1]} {text}: not {kind}") from None


CHOICES = "choose from"  # how a refused choice lists the others


class _HelpAll(argparse.Action):
    """--help-all: every flag of the command, then exit."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(parser.format_help_all(), sys.stdout)
        parser.exit()


def _briefly(action: argparse.Action) -> argparse.Action:
    """``action`` with its help as a short --help shows it (``flags.brief``)."""
    shown = copy.copy(action)
    shown.help = brief(action.help or "")
    return shown


def _looks_like_flag(word: str) -> bool:
    """Whether a word is a flag rather than a value (``-5`` is a value)."""
    try:
        float(word)
        return False
    except ValueError:
        return word.startswith("-")


def _takes(action: argparse.Action, value: str) -> bool:
    """Whether ``action``'s flag takes ``value``: a yes/no flag only true or false, a switch none."""
    if action.nargs == 0:
        return False
    yes_no = action.choices is not None and set(action.choices) == {"true", "false"}
    return not yes_no or value.lower() in ("true", "false")


# How the experiment settings' flags are grouped in --help (a setting not listed lands in the last group)
FLAG_GROUPS = {
    "core": ["nodes", "engine", "algorithm", "topology", "peer_sampling", "iterations", "seed"],
    "data and model": ["dataset", "task", "context", "vocabulary", "partition", "validation", "reshuffle", "model", "models_module"],
    "training": ["rounds", "objective", "batch_size", "lr", "lr_schedule", "outer", "dp", "privacy", "optimizer",
                 "momentum", "weight_decay", "full_epochs", "device", "threads"],
    "evaluation": ["test_after", "eval_nodes", "eval_samples", "train_evaluate", "topology_colour"],
    "transport and emulated network": ["transport", "net", "loss_mode", "slowdown", "host", "base_port"],
    "what nodes share, robust aggregation, attacks": ["sharing", "aggregation", "byzantine"],
    "outputs": ["output", "checkpoint_every", "checkpoint_keep"],
}
CONFIG_GROUP = " (flags override the config file)"  # the end of each experiment settings group's title
# What `simulate --help` shows (flag destinations by what they are for): the flags a first run changes;
# --help-all and docs/settings.md list every one. The order also ranks suggestions for a mistyped flag.
COMMON_FLAGS = {
    "what to run": ["config", "nodes", "engine", "algorithm", "topology", "iterations", "seed"],
    "data and model": ["dataset", "partition", "model"],
    "training": ["rounds", "batch_size", "lr", "optimizer"],
    "network and results": ["transport", "net", "test_after", "output", "resume", "dashboard", "quiet"],
}
NODE_FLAGS = {"this node": ["config", "addresses", "rank"],
              "often changed": ["host", "base_port", "output", "threads", "device"]}  # `node --help`'s
SECTION_GROUPS = {"tcp": "TCP transport", "udp": "UDP transport", "dpsgd": "D-PSGD", "gossip": "gossip",
                  "leader": "leader aggregation", "fedavg": "FedAvg", "pushsum": "push-sum",
                  "qgdsgdm": "quasi-global momentum", "mixing": "exchanges per iteration (multi-step gossip)",
                  "batched": "the batched engine"}


def _add_config_flags(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = (),
                      user_algorithms: bool = True) -> None:
    """One flag per experiment setting (flat names), grouped by what they are about; defaults stay
    in the settings models. ``leave_out``: settings this command does not take. ``user_algorithms``:
    the settings of the algorithms a loaded ``--models-module`` registered too, a group each."""
    where = {name: title for title, names in FLAG_GROUPS.items() for name in names}
    users = {flat: f"algorithm {algorithm} (--models-module)" for algorithm in DEFINITIONS.extensions()
             if (declared := user_settings_class(algorithm)) is not None for flat in declared.flat_names()}
    grouped: dict[str, list] = {title: [] for title in [*FLAG_GROUPS, *SECTION_GROUPS.values(), *users.values(),
                                                         "other settings"]}
    for name, field in flat_fields():
        if name in leave_out or (name in users and not user_algorithms):
            continue
        if name in users:
            grouped[users[name]].append((name, field))
            continue
        section = FLAT_ROUTES[name][0][0] if name in FLAT_ROUTES else None
        grouped[where.get(name) or SECTION_GROUPS.get(section, "other settings")].append((name, field))
    for title, fields in grouped.items():
        if fields:
            add_flags(parser.add_argument_group(title + CONFIG_GROUP), fields)


def _resolve(args: argparse.Namespace) -> ExperimentConfig:
    values: dict[str, Any] = read_config_file(args.config) if getattr(args, "config", None) else {}
    if isinstance(values.get("models_module"), str):  # the user's own file names it: its algorithms' settings
        with about("models_module", values["models_module"]):  # are then known by their flat names
            load_user_module(values["models_module"])
    values.update(given(args, [name for name, _ in flat_fields()]))
    config = make_config(values)
    if "topology" not in values and config.topology != DEFAULT_TOPOLOGY:
        print(f"note: no {DEFAULT_TOPOLOGY} graph has {config.nodes} nodes: the topology is {config.topology} "
              "(--topology chooses another)", file=sys.stderr)
    return config


def _run_simulation(config: ExperimentConfig, quiet: bool, args: argparse.Namespace | None = None,
                    resume: int | list[int] | None = None, launched: float | None = None) -> dict:
    from meshlearn.sim.checks import check_before_start

    check_before_start(config)  # a wrong name or a taken port: one line before torch even loads
    if args is not None:
        check_live_flags(args)
    from meshlearn.evaluation import PREDICTIONS_FIGURE
    from meshlearn.models import MODEL_FILE
    from meshlearn.sim import format_summary, simulate
    from meshlearn.sim.figures import PERPLEXITY_FIGURE

    if args is not None and (args.dashboard or args.tensorboard):
        result = _watched_simulation(config, quiet, args, resume, launched)
    else:
        result = simulate(config, progress=not quiet, launched=launched, resume=resume)
    if not result.main:  # one of torchrun's other processes: the first one reports
        return {}
    summary = json.loads((result.output / "summary.json").read_text())  # simulate() wrote the report
    print(format_summary(summary))
    figures = "accuracy.png, loss.png, topology.png, iteration_time.png" + \
        "".join(f", {name}" for name in (PREDICTIONS_FIGURE, PERPLEXITY_FIGURE) if (result.output / name).is_file())
    kept = f", {MODEL_FILE}" if (result.output / MODEL_FILE).is_file() else ""
    print(f"results: {result.output}  (summary.csv, {figures}{kept}, logs/)")
    return summary


def _watched_simulation(config: ExperimentConfig, quiet: bool, args: argparse.Namespace,
                        resume: int | list[int] | None = None, launched: float | None = None):
    """A simulation with its live page (--dashboard) and TensorBoard files (--tensorboard)."""
    from meshlearn.sim import simulate
    from meshlearn.sim.launcher import clear_earlier_run, default_output
    from meshlearn.sim.live import RunBoard

    if not config.output:
        config = config.model_copy(update={"output": str(default_output())})
    if Path(config.output, "logs").is_dir() and resume is None:
        clear_earlier_run(Path(config.output))  # the watcher must not read the last run's logs
    board = RunBoard(config, Path(config.output).name)
    with dashboard(args, board.snapshot), watch_run(args, config, [board] if args.dashboard else []):
        try:
            return simulate(config, progress=not quiet, launched=launched, resume=resume)
        except BaseException:
            board.finish("failed")
            raise


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.resume:
        from meshlearn.sim.resume import resume_point, saved_config, with_changes

        saved = saved_config(args.resume, args.models_module)  # refuses a models module the user did not name
        values: dict[str, Any] = read_config_file(args.config) if args.config else {}
        values.update(given(args, [name for name, _ in flat_fields()]))
        if saved.models_module and args.models_module:  # the run's own file (allowed above), however spelt
            values["models_module"] = saved.models_module
        config = with_changes(saved, values)
        iteration = resume_point(config)
        if not args.quiet:
            at = f"iteration {iteration}" if isinstance(iteration, int) else \
                f"iterations {min(iteration)} to {max(iteration)} (each node its own)"
            print(f"resuming {config.output} from its checkpoint at {at} of {config.iterations}", file=sys.stderr)
        _run_simulation(config, args.quiet, args, iteration, args.started)
        return 0
    _run_simulation(_resolve(args), args.quiet, args, launched=args.started)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    values = dict(DEMO)
    if args.output:
        values["output"] = args.output
    config = make_config(values)
    print(f"meshlearn demo: {config.nodes} nodes, D-PSGD on a 3-regular graph, {config.model} on digits")
    summary = _run_simulation(config, args.quiet, launched=args.started)
    print(f"final mean test accuracy: {summary['final']['accuracy'] * 100:.1f}%")
    print(f"plots: {Path(config.output) / 'accuracy.png'} and {Path(config.output) / 'loss.png'}")
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    from meshlearn.sim.multimachine import run_node

    config = _resolve(args)
    if not config.output:  # every rank on this machine writes into one folder, not one per start time
        config = config.model_copy(update={"output": str(Path("runs") / Path(args.addresses).stem)})
    summary = run_node(config, args.addresses, args.rank)
    metrics = summary.get("metrics")
    if metrics:
        print(f"node {args.rank}: test accuracy {metrics['accuracy']:.4f}, F1 {metrics['f1']:.4f}")
    return 0


def cmd_experiment(args: argparse.Namespace) -> int:
    from meshlearn.sim.experiment import load_experiment, run_experiment

    only = [name.strip() for name in args.runs.split(",") if name.strip()] if args.runs else None
    experiment = load_experiment(args.file, args.quick, args.output, batched=args.batched, only=only)
    check_live_flags(args)
    output = _watched_experiment(experiment, args) if (args.dashboard or args.tensorboard) else \
        run_experiment(experiment, progress=not args.quiet, resume=not args.restart)
    print((output / "table.md").read_text())
    print(f"report: {output}  (table.md, table.csv, per_node.csv, comparison.png, iteration_times.png)")
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from meshlearn.sim.sample import continue_text

    text = continue_text(args.results, args.prompt, args.tokens, args.temperature, args.seed, args.models_module)
    print(args.prompt + text)
    return 0


def _watched_experiment(experiment, args: argparse.Namespace) -> Path:
    """An experiment with its live page (--dashboard) and TensorBoard files (--tensorboard)."""
    from meshlearn.checkpoint import FOLDER as CHECKPOINTS
    from meshlearn.sim.experiment import run_experiment
    from meshlearn.sim.launcher import clear_earlier_run
    from meshlearn.sim.live import ExperimentBoard

    board = ExperimentBoard(experiment.name, [name for name, _ in experiment.runs])

    @contextlib.contextmanager
    def each_run(name: str, config: ExperimentConfig):
        if Path(config.output, "logs").is_dir() and (args.restart or not Path(config.output, CHECKPOINTS).is_dir()):
            clear_earlier_run(Path(config.output))  # (a run that resumes keeps its logs)
        run_board = board.begin(name, config)
        with watch_run(args, config, [run_board] if args.dashboard else []):
            try:
                yield
            except BaseException:
                board.end(name, "failed")
                raise
        board.end(name)

    with dashboard(args, board.snapshot):
        return run_experiment(experiment, progress=not args.quiet, around_run=each_run, resume=not args.restart)


def build_parser(user_algorithms: bool = True) -> argparse.ArgumentParser:
    """The `meshlearn` command line: the local commands (demo, simulate, experiment, sample, node)
    and the network's (``cli.network``); ``user_algorithms``: with the flags of the settings of the
    algorithms a loaded ``--models-module`` registered."""
    parser = _Parser(prog="meshlearn", description="Peer-to-peer training of PyTorch models.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more (before the command: meshlearn -v simulate ...)")
    parser.add_argument("--version", action="version", version=f"meshlearn {_version()}")
    sub = parser.commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    _add_demo(sub)
    _add_simulate(sub, user_algorithms)
    _add_experiment(sub)
    _add_sample(sub)
    _add_node(sub, user_algorithms)
    add_network_commands(sub)
    return parser


def _add_demo(sub) -> None:
    """Add the ``demo`` command: a quick D-PSGD run on digits."""
    demo = sub.add_parser("demo", help="8 nodes train an MLP on digits with D-PSGD (about 10 seconds)")
    demo.add_argument("--output", help="results folder (default: runs/demo)")
    demo.add_argument("--quiet", action="store_true", help="no progress bars or start-up messages")
    demo.set_defaults(func=cmd_demo)


def _add_simulate(sub, user_algorithms: bool = True) -> None:
    """Add the ``simulate`` command: N nodes on this machine, with every config flag."""
    about_simulate = "run N nodes on this machine (a process each, or all in one process with --engine batched)"
    simulate = sub.add_parser("simulate", help=about_simulate, description=about_simulate[:1].upper() +
                              about_simulate[1:] + ".")
    simulate.add_argument("--config", help="YAML experiment file; flags override its settings (default: none)")
    simulate.add_argument("--quiet", action="store_true", help="no progress bars or start-up messages")
    simulate.add_argument("--resume", metavar="FOLDER", help="continue the interrupted run in this results folder "
                          "from its newest checkpoint, with its own settings (default: a new run)")
    add_live_flags(simulate)
    _add_config_flags(simulate, user_algorithms=user_algorithms)
    simulate.show_common(COMMON_FLAGS)
    simulate.set_defaults(func=cmd_simulate)


def _add_experiment(sub) -> None:
    """Add the ``experiment`` command: the runs of an experiment file, compared."""
    experiment = sub.add_parser("experiment", help="run the runs of an experiment file and compare them")
    experiment.add_argument("file", help="experiment YAML file (see experiments/)")
    experiment.add_argument("--quick", action="store_true", help="the file's small scale, its 'quick' section (a 2-core CPU machine)")
    experiment.add_argument("--batched", action="store_true", help="every run on the batched engine (the file's "
                            "'batched' section; times modelled; runs marked 'batched: false' left out)")
    experiment.add_argument("--output", help="report folder (default: runs/<name>, plus -quick and/or -batched)")
    experiment.add_argument("--quiet", action="store_true", help="no progress bars or start-up messages")
    experiment.add_argument("--runs", help="only these runs of the file, comma-separated names (the report covers them) (default: all)")
    experiment.add_argument("--restart", action="store_true", help="run every run afresh (default: keep each run "
                            "whose folder holds a finished run of the same configuration, and continue one stopped "
                            "half-way from its newest checkpoint)")
    add_live_flags(experiment)
    experiment.set_defaults(func=cmd_experiment)


def _add_sample(sub) -> None:
    """Add the ``sample`` command: text a trained language model writes after a prompt."""
    sample = sub.add_parser("sample", help="print what a trained language model writes after a prompt")
    sample.add_argument("results", help="the results folder of a language-model run (pystdlib, text:PATH)")
    sample.add_argument("--prompt", default="def ", help="the text to continue (default: 'def ')")
    sample.add_argument("--tokens", type=int, default=200, help="bytes to write (default: 200)")
    sample.add_argument("--temperature", type=float, default=0.8, help="0: the likeliest byte each time; higher: "
                        "more varied (default: 0.8)")
    sample.add_argument("--seed", type=int, default=0, help="seed of the draws (default: 0)")
    sample.add_argument("--models-module", metavar="FILE", help="allow the results folder's config to import this "
                        "local .py file, the models module its run named; a folder that names one is refused "
                        "without it (default: none)")
    sample.set_defaults(func=cmd_sample)


def _add_node(sub, user_algorithms: bool = True) -> None:
    """Add the ``node`` command: one node of a multi-machine experiment."""
    node = sub.add_parser("node", help="run one node of a multi-machine experiment",
                          description="Run one node of a multi-machine experiment.")
    node.add_argument("--config", required=True, help="YAML experiment file shared by all machines")
    node.add_argument("--addresses", required=True, help="YAML file mapping rank -> host or host:port")
    node.add_argument("--rank", required=True, type=int, help="this node's rank")
    # --output (from the config flags) defaults to runs/<addresses file name> for `node`: all ranks share it;
    # a node is one process of the process engine, so it takes no --engine
    _add_config_flags(node, leave_out=("engine",), user_algorithms=user_algorithms)
    node.show_common(NODE_FLAGS)
    node.set_defaults(func=cmd_node)

def _version() -> str:
    try:
        return importlib.metadata.version("meshlearn")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def _load_user_algorithms(words: list[str]) -> None:
    """The ``--models-module`` of a ``simulate`` or ``node`` command, loaded before its flags are
    made: the algorithms it registers bring the flags of their settings (``--half-step-pull``)."""
    if next((word for word in words if not word.startswith("-")), None) not in ("simulate", "node"):
        return
    for at, word in enumerate(words):
        if word == "--models-module" and at + 1 < len(words):
            load_user_module(words[at + 1])
        elif word.startswith("--models-module="):
            load_user_module(word.partition("=")[2])


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    """Run one `meshlearn` command (``argv``: its words, default the process's); returns the exit code.
    ``started``: when the command began, as ``time.time()``, which a run's wall-clock counts from
    (default: now; the console script gives its process's start, ``cli.COMMAND_STARTED``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        _load_user_algorithms(words)
    except MeshlearnError as exc:
        print(f"meshlearn: error: {exc}", file=sys.stderr)
        return exc.exit_code
    parser = build_parser()
    args, unknown = parser.parse_known_args(words)
    if args.command is None and not unknown:  # bare `meshlearn`: what it can do
        parser.print_help()
        return 0
    if unknown:  # said by the command's own parser: its flags are the ones a typo may have meant
        command = parser.commands.choices.get(args.command, parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        args.started = time.time() if started is None else started
        return args.func(args)
    except MeshlearnError as exc:
        command = parser.commands.choices.get(args.command, parser)
        print(f"meshlearn {args.command}: error: {as_typed(exc, command, words)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"meshlearn {args.command}: interrupted; every node was stopped", file=sys.stderr)
        return 130


def entry() -> None:
    """The `meshlearn` console script and ``python3 -m meshlearn``: the command, its wall-clock counted
    from this process's start, then a prompt exit (``exit_now``)."""
    exit_now(main(started=COMMAND_STARTED))
