"""The process engine: N nodes on one machine, one OS process each, on loopback with race-free
port choice (``sim.run.run`` chooses it; ``run_processes`` is its entry).

Each node process binds its endpoint (any free port unless ``base_port`` is set), reports
the address to the launcher, receives the full address book, and runs. The launcher shows
progress and stops every process cleanly when one fails or the user presses Ctrl-C.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection
import multiprocessing.forkserver
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from meshlearn.checkpoint import FOLDER as CHECKPOINTS
from meshlearn.checkpoint import CheckpointStore
from meshlearn.config import ExperimentConfig
from meshlearn.data import partition_dataset, require_materialized
from meshlearn.errors import ConfigError, MeshlearnError, NodeFailure, TransportError
from meshlearn.models import build_model
from meshlearn.optim import optimizer_of
from meshlearn.runlog import COLUMNAR_LOG
from meshlearn.sim.checks import check_before_start
from meshlearn.sim.summary import RUN_TIMES
from meshlearn.topology import Graph, write_graph_file

STARTUP_TIMEOUT = 300.0
ORPHANED_EXIT = 3  # a node's exit code when its launcher died
FINISH_GRACE = 5.0  # seconds a node that reported its summary has to exit by itself before it is terminated
KILL_AFTER = 1.0  # seconds a terminated node has to exit before it is killed (SIGTERM ends one at once)

Say = Callable[[str], None]


def say_on_stderr(text: str) -> None:
    """Progress messages go to stderr, next to the progress bars, away from the results on stdout."""
    print(text, file=sys.stderr, flush=True)


def _silent(text: str) -> None:
    pass


def default_say(progress: bool) -> Say:
    """Where start-up messages go when the caller names nowhere: stderr with progress bars, nowhere without."""
    return say_on_stderr if progress else _silent


@dataclass
class SimulationResult:
    """Where a finished simulation wrote its results, and the per-node final summaries (``main``:
    whether this process wrote them; under ``torchrun`` only the first of the batched engine's
    processes does)."""

    output: Path
    summaries: dict[int, dict[str, Any]]
    main: bool = True


def default_output() -> Path:
    """A fresh results folder under ./runs named by the current time."""
    return Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S")


def _takes_cohort_path(config: ExperimentConfig) -> bool:
    """Whether a batched run takes FedAvg's cohort path (the batched engine is imported only here:
    a process-engine run's launcher never loads it)."""
    from meshlearn.batched.cohort import cohort_refusal

    return cohort_refusal(config) is None


def prepare_run(config: ExperimentConfig, keep_logs: bool = False, say: Say = _silent,
                resume: int | list[int] | None = None) -> tuple[Graph, Path]:
    """Check everything a user can get wrong before any process starts; write config and graph.

    A folder that holds an earlier run's node logs is started clean (they would mix into this
    run's report), unless ``keep_logs``: the nodes of a `meshlearn node` run share the folder and
    start at different moments (each truncates only its own log). A run that ``resume``s keeps
    its logs and checkpoints. Loading the dataset here also fills the on-disk decode cache the node
    processes share.
    """
    graph = check_before_start(config)
    check_device(config.device)
    say(f"loading dataset {config.dataset}")
    from meshlearn.node import load_run_dataset

    cohort = config.engine == "batched" and _takes_cohort_path(config)  # clients made when drawn
    dataset = load_run_dataset(config, whole=not cohort)
    if not (cohort and dataset.population is not None):  # a generated population's users are its parts
        require_materialized(dataset)
        partition_dataset(dataset, config.nodes, config.partition, config.seed)
    build_model(config.model, dataset.input_shape, dataset.num_classes)
    check_optimizer(config)
    output = Path(config.output) if config.output else default_output()
    output.mkdir(parents=True, exist_ok=True)
    if not keep_logs and resume is None:
        clear_earlier_run(output)
    (output / "config.yaml").write_text(config.model_copy(update={"output": str(output)}).to_yaml())
    write_graph_file(graph, output / "graph.txt")
    return graph, output


def check_optimizer(config: ExperimentConfig) -> None:
    """ConfigError, in one line, for optimizer arguments torch.optim refuses (``adam:foo=1``, or
    ``momentum`` for an optimizer without it), before any node process starts."""
    import torch

    optimizer_of(config, torch.zeros(1, 1))


def check_device(device: str) -> None:
    """ConfigError, in one line, for a device this machine does not have."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r}: CUDA is not available here (torch {torch.__version__}); "
                          "use --device cpu")
    if device == "mps" and not torch.backends.mps.is_available():
        raise ConfigError("device 'mps': Apple's MPS is not available here; use --device cpu")
    index = device.partition(":")[2] if device.startswith("cuda:") else ""
    if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
        raise ConfigError(f"device {device!r}: this machine has CUDA devices 0..{torch.cuda.device_count() - 1}")
    if not (device in ("cpu", "mps", "cuda") or device.startswith("cuda:")):
        raise ConfigError(f"device {device!r} is not cpu, cuda, cuda:N or mps")


def clear_earlier_run(output: Path) -> None:
    """Remove an earlier run's node logs and error files from ``output`` (and say so)."""
    stale = sorted((output / "logs").glob("node_*.jsonl")) + sorted((output / "logs").glob("node_*.error.txt"))
    stale += [path for path in [output / "logs" / COLUMNAR_LOG] if path.is_file()]
    for path in stale:
        path.unlink()
    (output / RUN_TIMES).unlink(missing_ok=True)
    CheckpointStore(output / CHECKPOINTS).clear()  # a fresh run must not resume from another's
    if stale:
        print(f"{output} held an earlier run: removed its {len(stale)} node log(s) so the runs do not mix",
              file=sys.stderr, flush=True)


def _exit_with_launcher() -> None:
    """End this node process the moment its launcher is gone: a SIGKILLed launcher runs no
    clean-up, and a node left behind would hold its port and CPU for good."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp.connection.wait([parent.sentinel])  # readable once the launcher's end is closed
        os._exit(ORPHANED_EXIT)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _node_process(rank: int, config_values: dict, edges: list, events, book_conn, log_dir: str,
                  resume: int | None = None) -> None:
    """Entry point of one node process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher alone handles Ctrl-C
    _exit_with_launcher()
    _name_this_process(f"meshlearn {rank}/{config_values['nodes']}")
    import torch

    from meshlearn.data.vocabulary import model_metadata
    from meshlearn.models import MODEL_FILE, save_weights
    from meshlearn.node import build_node

    try:
        config = ExperimentConfig(**config_values)
        torch.set_num_threads(config.threads)
        graph = Graph(config.nodes, [tuple(e) for e in edges])
        node = build_node(config, rank, graph, log_dir, resume=resume)
        transport = node.transport
        try:
            events.put(("bound", rank, transport.bind()))
            book = book_conn.recv()
            if book is None:
                return
            node.hooks.append(lambda _node, iteration, _record: events.put(("progress", rank, iteration + 1)))
            summary = node.run(node.contacts(book))
        finally:
            transport.close()
        if rank == 0:  # the run's final model, for `meshlearn sample` and anyone who wants it
            save_weights(node.model.state_dict(), Path(log_dir).parent / MODEL_FILE, model_metadata(node.dataset))
        events.put(("done", rank, summary))
    except MeshlearnError as exc:
        events.put(("error", rank, str(exc)))
        sys.exit(1)
    except Exception as exc:  # report any crash as one line; the traceback goes to a file
        Path(log_dir, f"node_{rank}.error.txt").write_text(traceback.format_exc())
        events.put(("error", rank, f"{type(exc).__name__}: {exc} (traceback in {log_dir}/node_{rank}.error.txt)"))
        sys.exit(1)


class _Launcher:
    """Owns the node processes of one simulation and guarantees they are gone at the end."""

    def __init__(self, config: ExperimentConfig, graph: Graph, output: Path, progress: bool, say: Say = _silent,
                 resume: int | list[int] | None = None):
        self.config = config
        self.resume = resume  # one iteration for every node, or one per rank
        self.graph = graph
        self.log_dir = output / "logs"
        self.progress = progress
        self.say = say
        self.ctx = mp.get_context("forkserver")
        self.events: Any = None  # made by run(), where Ctrl-C cannot cut its making in half
        self.procs: dict[int, mp.Process] = {}
        self.pipes: dict[int, Any] = {}
        self._dead_since: dict[int, float] = {}

    def run(self) -> dict[int, dict]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        values = self.config.model_dump()
        edges = self.graph.edges()
        try:
            with _ctrl_c_between_starts() as interrupted:
                self.events = self.ctx.Queue()
                start_forkserver(self.config)
                self._start_nodes(values, edges, interrupted)
            book = self._collect_addresses()
            for pipe in self.pipes.values():
                pipe.send(book)
            summaries = self._follow()
        except BaseException:  # Ctrl-C, a node that failed: the others stop at once
            self._stop_all(now=True)
            raise
        self._stop_all()
        return summaries

    def _start_nodes(self, values: dict, edges: list, interrupted: threading.Event) -> None:
        """Start one process per node; a Ctrl-C meanwhile (``interrupted``) is raised between two starts."""
        for rank in range(self.config.nodes):
            if interrupted.is_set():
                raise KeyboardInterrupt
            parent_end, child_end = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(
                target=_node_process, name=f"meshlearn-node-{rank}",
                args=(rank, values, edges, self.events, parent_end, str(self.log_dir),
                      self.resume[rank] if isinstance(self.resume, list) else self.resume),
            )
            proc.start()
            self.procs[rank], self.pipes[rank] = proc, child_end

    def _next_event(self, timeout: float):
        try:
            return self.events.get(timeout=timeout)
        except queue.Empty:
            self._check_alive()
            return None

    def _check_alive(self, finished: set[int] = frozenset()) -> None:
        """Raise for a node process that exited without finishing.

        A process's last event may still be in flight when its exit is seen, so it is only
        declared dead after a grace period in which its error (if any) is read normally.
        """
        now = time.monotonic()
        for rank, proc in self.procs.items():
            if rank in finished or proc.exitcode is None:
                continue
            since = self._dead_since.setdefault(rank, now)
            if now - since > 2.0:
                raise NodeFailure(f"node {rank} died with exit code {proc.exitcode} without reporting why")

    def _collect_addresses(self) -> dict[int, str]:
        from tqdm import tqdm

        book: dict[int, str] = {}
        started = time.monotonic()
        deadline = started + STARTUP_TIMEOUT
        with tqdm(total=self.config.nodes, desc="nodes started", unit="node", disable=not self.progress,
                  file=sys.stderr) as bar:
            while len(book) < self.config.nodes:
                if time.monotonic() > deadline:
                    raise TransportError(
                        f"only {len(book)} of {self.config.nodes} nodes started within {STARTUP_TIMEOUT:g} s")
                event = self._next_event(0.5)
                if event is None:
                    continue
                kind, rank, detail = event
                if kind == "error":
                    raise NodeFailure(f"node {rank} failed: {detail}")
                if kind == "bound":
                    book[rank] = detail
                    bar.update(1)
        self.say(f"{self.config.nodes} nodes up in {time.monotonic() - started:.1f} s: connecting to neighbours "
                 "and training")
        return book

    def _follow(self) -> dict[int, dict]:
        from tqdm import tqdm

        iterations = self.config.iterations
        first = min(self.resume) if isinstance(self.resume, list) else self.resume or 0
        at = {rank: first for rank in self.procs}
        summaries: dict[int, dict] = {}
        with tqdm(total=iterations, initial=first, desc="iterations", unit="it", disable=not self.progress,
                  file=sys.stderr) as bar:
            while len(summaries) < len(self.procs):
                try:
                    kind, rank, detail = self.events.get(timeout=0.5)
                except queue.Empty:
                    self._check_alive(set(summaries))
                    continue
                if kind == "error":
                    raise NodeFailure(f"node {rank} failed: {detail}")
                if kind == "progress":
                    at[rank] = detail
                    slowest = min(at.values())
                    if slowest > bar.n:
                        bar.update(slowest - bar.n)
                elif kind == "done":
                    summaries[rank] = detail
                    at[rank] = iterations
        return summaries

    def _stop_all(self, now: bool = False) -> None:
        """Leave no node process behind. After a run, each finished node is given FINISH_GRACE to
        exit by itself; on Ctrl-C or a failure (``now``) each is terminated at once: nodes ignore
        Ctrl-C and would train on (waiting for them made Ctrl-C take 5 s), and what a node keeps
        survives a kill (its checkpoints are written whole or not at all, ``--resume`` takes the last)."""
        for pipe in self.pipes.values():
            try:
                pipe.send(None)  # releases nodes still waiting for the address book
            except (OSError, ValueError):
                pass
        if not now:
            _join_all(self.procs.values(), FINISH_GRACE)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()  # SIGTERM: a node has no handler for it, so it ends at once
        _join_all(self.procs.values(), KILL_AFTER)
        for proc in self.procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self.events is not None:
            self.events.close()
            self.events.join_thread()


def _join_all(procs, seconds: float) -> None:
    """Wait up to ``seconds`` in all for ``procs`` to exit."""
    deadline = time.monotonic() + seconds
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))


def run_processes(config: ExperimentConfig, progress: bool = True, say: Say | None = None,
                  launched: float | None = None, resume: int | list[int] | None = None) -> SimulationResult:
    """The process engine: run ``config`` as ``config.nodes`` local node processes on this machine's
    network as it is (``sim.run.run`` picks this engine, and moves a kernel-loss run into a lossy
    namespace first); write its results folder.

    ``say`` hears what start-up is doing (default: stderr with progress, nothing without).
    ``launched``: when the run began, as ``time.time()`` (default: now); ``resume``: continue the
    run in ``config.output`` from its checkpoint of that iteration, or of these, one per rank
    (``sim.resume``)."""
    from meshlearn.sim.report import write_launched_report

    launched = time.time() if launched is None else launched
    say = say or default_say(progress)
    start_forkserver(config)  # its imports overlap the checks below
    try:
        graph, output = prepare_run(config, say=say, resume=resume)
        say(f"starting {config.nodes} node processes (each loads torch, its share of {config.dataset} and "
            f"model {config.model})")
        summaries = _Launcher(config, graph, output, progress, say, resume).run()
    except KeyboardInterrupt:
        stop_forkserver()  # the user is leaving: no process of the run may outlive the command
        raise
    write_launched_report(output, launched, config.models_module)  # the run its user named
    return SimulationResult(output, summaries)


def start_forkserver(config: ExperimentConfig) -> None:
    """Start the forkserver node processes are forked from, if it is not running: it imports what
    every node imports once (torch, the node, the dataset's loader: their pages shared), and does
    so while the caller goes on (run_processes starts it before it checks the run). Ctrl-C is ignored
    while it starts: the launcher alone handles Ctrl-C, and the forkserver ignores it itself only
    once its imports are done, so a Ctrl-C during start-up printed its KeyboardInterrupt traceback."""
    mp.get_context("forkserver").set_forkserver_preload(["torch", "meshlearn.node"])
    if threading.current_thread() is not threading.main_thread():
        mp.forkserver.ensure_running()  # signal handlers belong to the main thread, and so does Ctrl-C
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        mp.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)


def stop_forkserver() -> None:
    """Stop the forkserver now, if one runs (a later run starts another). Once its launcher is gone
    it would exit by itself, but only after unloading torch: it lingered for seconds after Ctrl-C.
    SIGTERM ends it at once (it handles only SIGINT and SIGCHLD); multiprocessing then reaps it and
    forgets it (``ForkServer._stop``, which alone would wait for that unloading)."""
    server = mp.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None or not hasattr(server, "_stop"):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    with contextlib.suppress(OSError):  # reaped or its socket file gone already
        server._stop()


@contextlib.contextmanager
def _ctrl_c_between_starts() -> Iterator[threading.Event]:
    """Ctrl-C while the run starts is taken between two steps, never inside one: a start
    interrupted halfway left a process the launcher did not know (so never stopped), which then
    failed with a traceback once the launcher was gone; a queue interrupted while it was made left
    a half-built multiprocessing finalizer, whose traceback Python printed at exit. Yields the event
    a Ctrl-C sets."""
    interrupted = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.set())
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted.is_set():  # one that came after the caller's last look
        raise KeyboardInterrupt


def _name_this_process(name: str) -> None:
    """Give this process a name ``ps -o comm``, top and htop show (``meshlearn 3/16``, at most 15
    bytes: Linux's limit), instead of the forkserver's command line (best effort, Linux only)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass
