"""The layering rule of docs/architecture.md: lower packages never import from higher ones, the
three services (sim, network, adapter) never import each other, and the wire format imports no
model code. Absolute and relative imports are both checked."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlearn"
# Higher number = higher layer. Shared modules are layer 0: any layer may use them, they use only each other.
LAYERS = {"wire": 1, "transport": 2, "definitions": 3, "aggregation": 3, "attacks": 3, "sharing": 3, "config": 4,
          "training": 4, "iterations": 4, "node": 4, "batched": 4, "sim": 5, "adapter": 5, "network": 5, "dashboard": 5, "cli": 6}
SHARED = {"errors", "settings", "clock", "lazy", "flat", "netem", "metrics", "evaluation", "sgd", "plots", "runlog", "topology", "data", "models",
          "threads", "plugins", "tblog", "accepting", "optim", "sparselog", "layout", "tasks", "schedule", "outer", "checkpoint",
          "privacy", "suggest", "exiting", "enginesettings", "meta"}
SIBLINGS = {"sim", "network", "adapter", "dashboard"}  # services built on the engine, side by side
ENGINES = {"node", "batched", "sim"}  # the two engines and the service that picks one
ENTRY_POINTS = {None, "__main__"}  # the package itself and ``python -m meshlearn``: above every layer
MODEL_CODE = {"torch.nn", "meshlearn.models", "meshlearn.data", "meshlearn.topology", "meshlearn.flat"}
MODULES = sorted(SRC.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = ("meshlearn",) + path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, run_time: bool = False) -> list[str]:
    """Every module ``path`` imports, relative imports resolved (``run_time``: not those only type
    checkers read, under ``if TYPE_CHECKING:``)."""
    own = _module_name(path)
    return _imports_of(path.read_text(), own if path.name == "__init__.py" else own.rpartition(".")[0], run_time)


def _imports_of(source: str, package: str, run_time: bool = False) -> list[str]:
    """Every module ``source`` (a module of ``package``) imports, relative imports resolved."""
    names = []
    tree = ast.parse(source)
    if run_time:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.append(module)
            names += [f"{module}.{alias.name}" for alias in node.names]  # from pkg import submodule
    return names


def _top(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "meshlearn" and len(parts) > 1 else None


def _layer(top: str | None) -> int | None:
    return 0 if top in SHARED else LAYERS.get(top)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_follow_the_drawing(path):
    own = _top(_module_name(path))
    if _layer(own) is None:  # the package's entry points (meshlearn, __main__)
        return
    for name in _imports(path):
        other = _top(name)
        if other is None or other == own or _layer(other) is None:
            continue
        if own in SHARED:
            assert other in SHARED, f"{path.name} is shared but imports {name} from a layer"
        assert _layer(other) <= _layer(own), f"{own} (layer {_layer(own)}) imports {name} (layer {_layer(other)})"
        assert not (own in SIBLINGS and other in SIBLINGS), f"{own} imports its sibling {other} ({name})"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_every_module_has_a_place_in_the_drawing(path):
    """A module in neither LAYERS nor SHARED would have its imports checked by nothing."""
    own = _top(_module_name(path))
    assert own in ENTRY_POINTS or _layer(own) is not None, \
        f"{own} is in no layer: add it to LAYERS or SHARED in tests/test_layers.py"


def test_the_configuration_imports_no_engine():
    """The configuration sits beside the engines, not above them: they read it, it imports none of
    them (the settings they own live in shared modules), so checking a configuration loads no engine."""
    for name in _imports(SRC / "config.py"):
        assert _top(name) not in ENGINES, f"config.py imports {name} from an engine package"


@pytest.mark.parametrize("path", sorted((SRC / "wire").rglob("*.py")), ids=lambda p: p.name)
def test_the_wire_format_imports_no_model_code(path):
    for name in _imports(path):
        assert not any(name == m or name.startswith(m + ".") for m in MODEL_CODE), f"{path.name} imports {name}"


def test_relative_imports_are_resolved():
    names = _imports_of("from ..base import Endpoint\nfrom . import sender\nfrom ...cli import main\n",
                        "meshlearn.transport.udp")
    assert {"meshlearn.transport.base", "meshlearn.transport.udp.sender", "meshlearn.cli.main"} <= set(names)


@pytest.mark.parametrize("path", sorted((SRC / "definitions").rglob("*.py")), ids=lambda p: p.name)
def test_the_algorithm_layer_uses_no_engine_transport_or_config(path):
    """Algorithm definitions are torch only: shared modules, each other and the torch-only rules
    beside them (aggregation, sharing), no sockets, engine or configuration (docs/architecture.md)."""
    for name in _imports(path):
        other = _top(name)
        assert other is None or other in ("definitions", "aggregation", "sharing") or other in SHARED, \
            f"{path.name} imports {name}"
        assert not name.startswith(("zmq", "socket")), f"{path.name} imports {name}"



def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each group of nodes that reach one another along ``edges`` (node -> the nodes it points at)."""

    def reach(start: str) -> set[str]:
        seen, frontier = set(), set(edges[start])
        while frontier:
            seen |= frontier
            frontier = {nxt for node in frontier for nxt in edges.get(node, ())} - seen
        return seen

    reached = {node: reach(node) for node in edges}
    groups = {frozenset([node] + [other for other in reached[node] if node in reached.get(other, ())])
              for node in edges if node in reached[node]}
    return sorted(sorted(group) for group in groups)


def _lazy_exports_of(source: str, package: str) -> dict[str, str]:
    """``package.Name`` -> the submodule defining it, for each name a package's ``__init__`` (its
    ``source``) exports on first use through ``lazy_exports(__name__, WHERE)``: importing such a
    name imports that submodule, though the ``__init__`` itself imports none."""
    tree = ast.parse(source)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "lazy_exports"]
    wanted = {ast.unparse(call.args[1]) for call in calls}
    exports: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(ast.unparse(target) in wanted for target in node.targets):
            exports |= eval(ast.unparse(node.value), {"__builtins__": {}})  # a literal: strings, dict comprehensions
    return {f"{package}.{name}": f"{package}.{module}" for name, module in exports.items()}


def _reexports() -> dict[str, str]:
    """Every name a package of meshlearn exports on first use -> the module defining it."""
    inits = [path for path in MODULES if path.name == "__init__.py"]
    return {name: module for path in inits for name, module in _lazy_exports_of(path.read_text(), _module_name(path)).items()}


def _import_cycles(package: str) -> list[list[str]]:
    """The import cycles among ``package``'s modules (imports at the top and inside functions alike;
    a name a package exports on first use counts as an import of the module defining it)."""
    modules = {_module_name(path): path for path in MODULES if _module_name(path).startswith(package)}
    reexports = _reexports()

    def module_of(name: str) -> str | None:  # the module of ``package`` an imported name lies in
        parts = reexports.get(name, name).split(".")
        return next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules), None)

    return _cycles({own: {found for name in _imports(path, run_time=True)
                          if (found := module_of(name)) not in (None, own)} for own, path in modules.items()})


def test_import_cycles_are_found():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]
    assert _cycles({"run": {"launcher", "kernelnet"}, "kernelnet": set(), "launcher": set()}) == []
    before = {"launcher": {"kernelnet", "report"}, "kernelnet": {"launcher"}, "report": set()}  # sim before run.py
    assert _cycles(before) == [["kernelnet", "launcher"]]


def test_names_a_package_exports_on_first_use_lead_to_their_module():
    """``from meshlearn.tasks import task_of`` imports tasks.base, not only the package's light
    ``__init__``: a cycle through such a name is a cycle."""
    init = ('from meshlearn.lazy import lazy_exports\n'
            '_WHERE = {"Task": "base", **{name: "spec" for name in ("TASKS", "resolve_task")}}\n'
            '__getattr__ = lazy_exports(__name__, _WHERE)\n')
    assert _lazy_exports_of(init, "meshlearn.tasks") == {
        "meshlearn.tasks.Task": "meshlearn.tasks.base", "meshlearn.tasks.TASKS": "meshlearn.tasks.spec",
        "meshlearn.tasks.resolve_task": "meshlearn.tasks.spec"}
    assert _reexports()["meshlearn.tasks.task_of"] == "meshlearn.tasks.base"


def test_the_sim_modules_import_without_a_cycle():
    """sim.run picks the engine and imports them; no engine imports it or another engine back (the
    kernel-loss child is given the process engine's entry, it does not import it)."""
    assert _import_cycles("meshlearn.sim") == []


def test_no_module_imports_itself_back():
    """No import cycle anywhere in the package (imports only type checkers read aside): an engine's
    registry of runtimes, its runners and its network import one way."""
    assert _import_cycles("meshlearn") == []


def test_the_batched_engine_loads_no_sockets_and_the_configuration_no_torch():
    """Rules both engines use live below them (the algorithm layer, aggregation, data), not in
    process-engine files that would pull ZeroMQ into the batched engine; a configuration is
    checked, algorithm declarations included, before torch loads."""
    import subprocess
    import sys

    probe = ("import sys, importlib; importlib.import_module(sys.argv[1]); "
             "print(sorted(m for m in ('zmq', 'torch', 'meshlearn.node', 'meshlearn.wire') if m in sys.modules))")
    engine = subprocess.run([sys.executable, "-c", probe, "meshlearn.batched.engine"], capture_output=True, text=True,
                            check=True)
    assert engine.stdout.strip() == "['torch']"
    config = subprocess.run([sys.executable, "-c", probe + "; from meshlearn.config import make_config; "
                             "make_config({'algorithm': 'pushsum', 'topology': 'one-peer-exponential'}); "
                             "make_config({'algorithm': 'gossip'}); print('torch' in sys.modules)", "meshlearn.config"],
                            capture_output=True, text=True, check=True)
    assert config.stdout.split() == ["[]", "False"]


# The network's own floors (docs/architecture.md): the channel carries bytes between keys, the task is
# what both sides share, the protocol declares every request, the bootstrap and the provider serve
# side by side, the requester sits on top.
NETWORK_FLOORS = {"channel": 1, "task": 2, "protocol": 3, "bootstrap": 4, "provider": 4, "requester": 5}
NETWORK_MODULES = sorted((SRC / "network").rglob("*.py"))


def _network_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["meshlearn", "network"] and len(parts) > 2 else None


@pytest.mark.parametrize("path", NETWORK_MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_the_network_packages_import_down(path):
    """Each module of network/ sits in one of its packages, and imports only its own package's
    modules and the packages below it; the bootstrap and the provider never import each other."""
    own = _network_part(_module_name(path))
    if own is None:  # network/__init__.py
        return
    assert own in NETWORK_FLOORS, f"network/{own} is in none of the network's packages: add it to NETWORK_FLOORS"
    for name in _imports(path):
        other = _network_part(name)
        if other is None or other == own or other not in NETWORK_FLOORS:
            continue
        assert NETWORK_FLOORS[other] < NETWORK_FLOORS[own], \
            f"network/{own} (floor {NETWORK_FLOORS[own]}) imports {name} (floor {NETWORK_FLOORS[other]})"


def test_network_modules_and_classes_stay_small():
    """No module of network/ over 600 lines and no class over 300: a newcomer reads one job at a time."""
    for path in NETWORK_MODULES:
        lines = len(path.read_text().splitlines())
        assert lines <= 600, f"{path.relative_to(SRC)} has {lines} lines: split it by job"
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                assert size <= 300, f"{path.relative_to(SRC)}: class {node.name} has {size} lines: split it"
