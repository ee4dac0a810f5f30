"""Checkpoints: a run's state between two iterations, on disk as safetensors (every tensor and
array) plus JSON (everything else), never pickle, each file written atomically.

What a component keeps is declared, not discovered: a ``Stateful`` class names the attributes a
checkpoint holds (``state_fields``), and ``capture`` / ``restore`` walk them. Restoring writes the
saved values into the objects a run has just built from its configuration, in place where it can
(a tensor other tensors are views of stays that tensor), so the structure always comes from the
configuration and a file only ever supplies values, each checked against what it replaces.

On disk, a run's checkpoints live in ``checkpoints/`` of its results folder, one folder per
iteration (``00000050/``), holding one ``NAME.safetensors`` + ``NAME.json`` pair per writer (the
batched engine: one, ``nodes``; the process engine: one per node). The JSON file is written last
and names the SHA-256 of its tensors, so a pair is complete and intact or it is not used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

from meshlearn.errors import CheckpointError

if TYPE_CHECKING:
    import torch

FORMAT = 1  # the version of the layout below; a checkpoint of another is refused
FOLDER = "checkpoints"  # in a run's results folder
MAX_DEPTH = 64  # nesting a saved tree may have: a run's deepest (an engine's optimizer states) has about 14
_PCG64_KEYS = {"bit_generator", "state", "has_uint32", "uinteger"}  # numpy's PCG64 state, exactly
_PY_RNG_WORDS = 625  # Python's Mersenne Twister state: 624 words and an index (random.Random.VERSION 3)
_TENSOR, _ARRAY, _NUMPY_RNG, _TORCH_RNG, _PY_RNG, _OPTIMIZER, _OBJECT, _TUPLE, _PAIRS = (
    "$tensor", "$array", "$numpy_rng", "$torch_rng", "$python_rng", "$optimizer", "$object", "$tuple", "$pairs")


class Stateful:
    """A component with state a checkpoint keeps: ``state_fields`` names its attributes (tensors,
    arrays, generators, numbers, strings, other ``Stateful`` objects, and lists, tuples and dicts
    of them); ``state_dict`` captures them, ``load_state`` writes them back."""

    state_fields: ClassVar[tuple[str, ...]] = ()

    def state_dict(self) -> dict[str, Any]:
        """The declared attributes, captured (``capture``)."""
        return {name: capture(getattr(self, name)) for name in self.state_fields}

    def load_state(self, state: dict[str, Any], device: torch.device | str = "cpu") -> None:
        """Write ``state`` (what ``state_dict`` returned, maybe read back from disk) into this
        object; CheckpointError if it does not fit."""
        if not isinstance(state, dict) or set(state) != set(self.state_fields):
            raise CheckpointError(f"the checkpoint's {type(self).__name__} holds "
                                  f"{sorted(state) if isinstance(state, dict) else type(state).__name__}, not "
                                  f"{sorted(self.state_fields)}")
        for name in self.state_fields:
            setattr(self, name, restore(getattr(self, name), state[name], device, f"{type(self).__name__}.{name}"))


def capture(value: Any) -> Any:
    """``value`` as a tree of JSON values and CPU tensors (copies: later steps do not change it)."""
    import numpy as np
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Stateful):
        return {_OBJECT: value.state_dict()}
    if isinstance(value, torch.Tensor):
        return {_TENSOR: value.detach().to("cpu", copy=True)}
    if isinstance(value, np.ndarray):
        return {_ARRAY: torch.from_numpy(np.array(value, copy=True)), "dtype": value.dtype.str}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.random.Generator):
        return {_NUMPY_RNG: value.bit_generator.state}
    if isinstance(value, torch.Generator):
        return {_TORCH_RNG: value.get_state()}
    if isinstance(value, random.Random):
        version, internal, gauss = value.getstate()
        return {_PY_RNG: [version, list(internal), gauss]}
    if _is_optimizer(value):
        return {_OPTIMIZER: capture(value.state_dict())}
    if isinstance(value, tuple):
        return {_TUPLE: [capture(item) for item in value]}
    if isinstance(value, list):
        return [capture(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) and not key.startswith("$") for key in value):
            return {key: capture(item) for key, item in value.items()}
        return {_PAIRS: [[capture(key), capture(item)] for key, item in value.items()]}
    raise TypeError(f"a checkpoint cannot keep a {type(value).__name__}")


def restore(current: Any, saved: Any, device: torch.device | str = "cpu", where: str = "state") -> Any:
    """The value to hold in place of ``current`` after a checkpoint that saved ``saved``: tensors,
    arrays and generators are written into ``current`` when it has their shape (views of it stay
    views), ``Stateful`` objects and lists of them load their own; CheckpointError where the saved
    value does not fit ``current`` (another shape, type or length: the run changed)."""
    import numpy as np
    import torch

    if isinstance(current, Stateful):
        if not (isinstance(saved, dict) and _OBJECT in saved):
            raise CheckpointError(f"the checkpoint holds no {type(current).__name__} at {where}")
        current.load_state(saved[_OBJECT], device)
        return current
    if _is_optimizer(current):
        if not (isinstance(saved, dict) and _OPTIMIZER in saved):
            raise CheckpointError(f"the checkpoint holds no optimizer state at {where}")
        try:
            current.load_state_dict(decode(saved[_OPTIMIZER], device))
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise CheckpointError(f"the checkpoint's optimizer state at {where} does not fit: {exc}") from None
        return current
    if isinstance(current, list) and isinstance(saved, list) and len(current) == len(saved) and any(
            isinstance(item, (Stateful, torch.Tensor, np.ndarray, np.random.Generator, torch.Generator))
            for item in current):
        return [restore(item, entry, device, f"{where}[{index}]") for index, (item, entry)
                in enumerate(zip(current, saved))]
    if isinstance(current, dict) and isinstance(saved, dict) and _PAIRS not in saved and set(current) == set(saved) \
            and not any(key.startswith("$") for key in saved):
        return {key: restore(current[key], saved[key], device, f"{where}.{key}") for key in current}
    value = decode(saved, device, where)
    if isinstance(current, torch.Tensor) and isinstance(value, torch.Tensor):
        if current.shape != value.shape or current.dtype != value.dtype:
            raise CheckpointError(f"the checkpoint's {where} is {value.dtype} {tuple(value.shape)}, the run's "
                                  f"{current.dtype} {tuple(current.shape)}: it is of another run")
        current.copy_(value)
        return current
    if isinstance(current, np.ndarray) and isinstance(value, np.ndarray):
        if current.shape != value.shape or current.dtype != value.dtype:
            raise CheckpointError(f"the checkpoint's {where} is {value.dtype} {value.shape}, the run's "
                                  f"{current.dtype} {current.shape}: it is of another run")
        np.copyto(current, value)
        return current
    if isinstance(current, np.random.Generator) and isinstance(value, np.random.Generator):
        current.bit_generator.state = value.bit_generator.state
        return current
    if isinstance(current, torch.Generator) and isinstance(value, torch.Generator):
        current.set_state(value.get_state())
        return current
    if current is not None and value is not None and not _same_kind(current, value):
        raise CheckpointError(f"the checkpoint's {where} is a {type(value).__name__}, the run's a "
                              f"{type(current).__name__}: it is of another run")
    return value


def _is_optimizer(value: Any) -> bool:
    """Whether ``value`` is a ``torch.optim`` optimizer (without importing ``torch.optim``, which a
    run on meshlearn's own SGD never loads: it would cost every node process about 70 MB)."""
    optim = sys.modules.get("torch.optim")
    return optim is not None and isinstance(value, optim.Optimizer)


def _same_kind(current: Any, value: Any) -> bool:
    numbers = (int, float)
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(current, bool) and isinstance(value, bool)
    if isinstance(current, numbers) and isinstance(value, numbers):
        return True
    return isinstance(value, type(current)) or isinstance(current, type(value))


def decode(saved: Any, device: torch.device | str = "cpu", where: str = "state") -> Any:
    """A captured tree as values of their own (tensors on ``device``, arrays, generators);
    CheckpointError, and nothing else, for a tree that is not one ``capture`` could have made."""
    _check_depth(saved, f"the checkpoint's {where}")
    return _decode(saved, device, where)


def _check_depth(tree: Any, what: str) -> None:
    """CheckpointError where ``tree`` (``what``, in the error) nests deeper than ``MAX_DEPTH``
    (walked without recursion, so that the walks after it, which recurse, cannot exhaust the stack)."""
    level = [tree]
    for _ in range(MAX_DEPTH + 1):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)]
        if not level:
            return
    raise CheckpointError(f"{what} nests deeper than {MAX_DEPTH} levels: the checkpoint is damaged")


def _decode(saved: Any, device: torch.device | str, where: str) -> Any:
    import numpy as np
    import torch

    if saved is None or isinstance(saved, (bool, int, float, str)):
        return saved
    if isinstance(saved, list):
        return [_decode(item, device, where) for item in saved]
    if not isinstance(saved, dict):
        raise CheckpointError(f"the checkpoint's {where} is a {type(saved).__name__}")
    if _TENSOR in saved:
        return _tensor(saved[_TENSOR], where).to(device)
    if _ARRAY in saved:
        try:
            return _tensor(saved[_ARRAY], where).numpy().astype(_array_dtype(saved.get("dtype"), where), copy=True)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's array at {where} is damaged: {exc}") from None
    if _NUMPY_RNG in saved:
        generator = np.random.default_rng()
        generator.bit_generator.state = _pcg64_state(saved[_NUMPY_RNG], where)
        return generator
    if _TORCH_RNG in saved:
        state = _tensor(saved[_TORCH_RNG], where)
        if state.dtype != torch.uint8 or state.dim() != 1:
            raise CheckpointError(f"the checkpoint's generator at {where} is {state.dtype} {list(state.shape)}, "
                                  "not a torch generator's state (a vector of bytes)")
        generator = torch.Generator()
        try:
            generator.set_state(state)
        except RuntimeError as exc:
            raise CheckpointError(f"the checkpoint's generator at {where} is damaged: {exc}") from None
        return generator
    if _PY_RNG in saved:
        generator = random.Random()
        try:
            generator.setstate(_python_rng_state(saved[_PY_RNG], where))
        except ValueError as exc:
            raise CheckpointError(f"the checkpoint's generator at {where} is damaged: {exc}") from None
        return generator
    if _OBJECT in saved:
        raise CheckpointError(f"the checkpoint holds a component at {where} the run does not have")
    if _OPTIMIZER in saved:
        return _decode(saved[_OPTIMIZER], device, where)
    if _TUPLE in saved:
        if not isinstance(saved[_TUPLE], list):
            raise CheckpointError(f"the checkpoint's tuple at {where} is damaged")
        return tuple(_decode(item, device, where) for item in saved[_TUPLE])
    if _PAIRS in saved:
        pairs = saved[_PAIRS]
        if not isinstance(pairs, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            raise CheckpointError(f"the checkpoint's mapping at {where} is damaged")
        return {_key(_decode(key, device, where), where): _decode(item, device, where) for key, item in pairs}
    return {key: _decode(item, device, f"{where}.{key}") for key, item in saved.items()}


def _is_whole(value: Any, bits: int) -> bool:
    """Whether ``value`` is an int (not a bool) of ``bits`` unsigned bits."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << bits


def _array_dtype(name: Any, where: str) -> Any:
    """The numpy dtype a saved array names: one of numbers or booleans, as ``capture`` records
    (from a tensor), never objects, strings or records (which would not be numbers, or be huge)."""
    import numpy as np

    if not isinstance(name, str):
        raise CheckpointError(f"the checkpoint's array at {where} names no dtype")
    dtype = np.dtype(name)  # TypeError for a name numpy does not know (the caller says so)
    if dtype.kind not in "biufc" or dtype.shape or dtype.names is not None:
        raise CheckpointError(f"the checkpoint's array at {where} is of dtype {name!r}, not of numbers")
    return dtype


def _pcg64_state(state: Any, where: str) -> dict:
    """``state`` if it is numpy's PCG64 state (its fields, of their types and ranges, which numpy
    itself would turn into OverflowError or take as they come); CheckpointError otherwise."""
    if not isinstance(state, dict) or state.get("bit_generator") != "PCG64":
        raise CheckpointError(f"the checkpoint's generator at {where} is not numpy's PCG64")
    inner = state.get("state")
    if set(state) != _PCG64_KEYS or not isinstance(inner, dict) or set(inner) != {"state", "inc"} \
            or not all(_is_whole(value, 128) for value in inner.values()) \
            or not _is_whole(state["has_uint32"], 1) or not _is_whole(state["uinteger"], 32):
        raise CheckpointError(f"the checkpoint's generator at {where} is damaged: not a PCG64 state (a 128-bit "
                              "state and increment, a 32-bit spare word)")
    return state


def _python_rng_state(saved: Any, where: str) -> tuple:
    """``saved`` (what ``capture`` made of a ``random.Random``) as the state ``setstate`` takes,
    once its version, its words and their ranges are checked; CheckpointError otherwise."""
    if not (isinstance(saved, list) and len(saved) == 3
            and _is_whole(saved[0], 8) and saved[0] == random.Random.VERSION and isinstance(saved[1], list) and len(saved[1]) == _PY_RNG_WORDS
            and all(_is_whole(word, 32) for word in saved[1])
            and (saved[2] is None or isinstance(saved[2], float))):
        raise CheckpointError(f"the checkpoint's generator at {where} is damaged: not a Python generator's state "
                              f"(version {random.Random.VERSION}, {_PY_RNG_WORDS} 32-bit words)")
    version, internal, gauss = saved
    return version, tuple(internal), gauss


def _key(key: Any, where: str) -> Any:
    if isinstance(key, list):
        key = tuple(key)
    try:
        hash(key)
    except TypeError:
        raise CheckpointError(f"the checkpoint's mapping at {where} has a key that cannot be one") from None
    return key


def _tensor(value: Any, where: str) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"the checkpoint's tensor at {where} is missing")
    return value


def _pack(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``tree`` with each tensor replaced by its name in ``tensors`` (where it is added)."""
    import torch

    if isinstance(tree, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = tree.contiguous()
        return {"$file": name}
    if isinstance(tree, list):
        return [_pack(item, tensors) for item in tree]
    if isinstance(tree, dict):
        return {key: _pack(item, tensors) for key, item in tree.items()}
    return tree


def _unpack(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, list):
        return [_unpack(item, tensors) for item in tree]
    if isinstance(tree, dict):
        if set(tree) == {"$file"}:
            name = tree["$file"]
            if not isinstance(name, str) or name not in tensors:
                raise CheckpointError(f"the checkpoint names a tensor {name!r} its file does not hold")
            return tensors[name]
        return {key: _unpack(item, tensors) for key, item in tree.items()}
    return tree


def parse_checkpoint(meta_bytes: bytes, tensor_bytes: bytes, iteration: int,
                     where: str = "checkpoint") -> tuple[dict[str, Any], dict[str, Any]]:
    """(meta, tree) of one checkpoint's two files (``where``: what to call it in an error);
    CheckpointError, in one line, for one that is damaged, of another format or not of
    ``iteration``. Nothing in it is executed: JSON values and tensors only."""
    from safetensors import SafetensorError
    from safetensors.torch import load as load_tensors

    try:
        meta = json.loads(meta_bytes.decode())
    except (ValueError, RecursionError) as exc:  # ValueError: UnicodeDecodeError, JSONDecodeError, a huge number
        raise CheckpointError(f"{where}.json is not valid JSON ({exc}): the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{where}.json is not a checkpoint of format {FORMAT} (this version's)")
    if meta.get("iteration") != iteration:
        raise CheckpointError(f"{where}.json says it is of iteration {meta.get('iteration')}, not {iteration}")
    if hashlib.sha256(tensor_bytes).hexdigest() != meta.get("sha256"):
        raise CheckpointError(f"{where}.safetensors does not match its checksum: the checkpoint is damaged")
    try:
        tensors = load_tensors(tensor_bytes)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{where}.safetensors is not a valid safetensors file: {exc}") from None
    _check_depth(meta, f"{where}.json")
    tree = _unpack(meta.pop("state", None), tensors)
    if not isinstance(tree, dict):
        raise CheckpointError(f"{where}.json holds no state")
    return meta, tree


def _write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` or what it held before, never part of it (a rename of a synced file)."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with partial.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


class CheckpointStore:
    """The checkpoints of one run (``root``: its ``checkpoints/`` folder), at most ``keep`` per
    writer: writing one removes that writer's older ones beyond the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = max(1, keep)

    def folder(self, iteration: int) -> Path:
        """Where the checkpoints taken after ``iteration`` iterations are."""
        return self.root / f"{iteration:08d}"

    def iterations(self) -> list[int]:
        """The iterations with a checkpoint folder, oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(int(path.name) for path in self.root.iterdir() if path.is_dir() and path.name.isdigit())

    def has(self, iteration: int, name: str) -> bool:
        """Whether writer ``name`` finished its checkpoint of ``iteration`` (its JSON is written last)."""
        return (self.folder(iteration) / f"{name}.json").is_file()

    def latest(self, names: Iterable[str]) -> int | None:
        """The newest iteration every writer of ``names`` finished a checkpoint of; None if none."""
        names = list(names)
        done = [iteration for iteration in self.iterations() if all(self.has(iteration, name) for name in names)]
        return done[-1] if done else None

    def save(self, iteration: int, name: str, tree: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write writer ``name``'s checkpoint of ``iteration``: ``tree`` (from ``capture``) and
        ``meta`` (JSON values: what the run is, where it was); then drop its older ones."""

        from safetensors.torch import save as save_tensors

        folder = self.folder(iteration)
        folder.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        packed = _pack(tree, tensors)
        data = save_tensors(tensors)
        _write_atomically(folder / f"{name}.safetensors", data)
        record = {"format": FORMAT, "iteration": iteration, **meta, "sha256": hashlib.sha256(data).hexdigest(),
                  "state": packed}
        _write_atomically(folder / f"{name}.json", json.dumps(record, separators=(",", ":")).encode())
        self._prune(name)
        return folder

    def load(self, iteration: int, name: str) -> tuple[dict[str, Any], dict[str, Any]]:
        """(meta, tree) of writer ``name``'s checkpoint of ``iteration``; CheckpointError, in one
        line, for one that is missing, damaged, of another format or not the iteration it says."""
        folder = self.folder(iteration)
        meta_path, tensor_path = folder / f"{name}.json", folder / f"{name}.safetensors"
        if not meta_path.is_file() or not tensor_path.is_file():
            raise CheckpointError(f"checkpoint {folder} has no {name}.json and {name}.safetensors: it is incomplete")
        return parse_checkpoint(meta_path.read_bytes(), tensor_path.read_bytes(), iteration, str(folder / name))

    def put(self, iteration: int, name: str, meta: bytes, tensors: bytes, fingerprint: str | None = None) -> None:
        """Keep writer ``name``'s checkpoint of ``iteration`` as received whole (its two files'
        bytes), once checked (``parse_checkpoint``; with ``fingerprint``, that it is of that run):
        CheckpointError for a bad one, nothing written."""
        fields, _ = parse_checkpoint(meta, tensors, iteration, name)
        if fingerprint is not None and fields.get("fingerprint") != fingerprint:
            raise CheckpointError("it is of another training (another fingerprint)")
        folder = self.folder(iteration)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(folder / f"{name}.safetensors", tensors)
        _write_atomically(folder / f"{name}.json", meta)
        self._prune(name)

    def _prune(self, name: str) -> None:
        mine = [iteration for iteration in self.iterations() if self.has(iteration, name)]
        for iteration in mine[:-self.keep]:
            folder = self.folder(iteration)
            for suffix in (".json", ".safetensors"):
                (folder / f"{name}{suffix}").unlink(missing_ok=True)
            try:
                folder.rmdir()  # the last writer to leave removes it
            except OSError:
                pass

    def clear(self) -> None:
        """Remove every checkpoint (a run started afresh in the folder)."""
        shutil.rmtree(self.root, ignore_errors=True)


class RunCheckpoints:
    """One writer's checkpoints of a run (``name``: the batched engine's ``nodes``, a process-engine
    node's ``node-R``) in the results folder ``output``; ``fingerprint``: the run's configuration
    (``ExperimentConfig.fingerprint``), recorded in each and checked on loading."""

    def __init__(self, output: str | Path, name: str, fingerprint: str, keep: int = 2):
        self.store = CheckpointStore(Path(output) / FOLDER, keep)
        self.name, self.fingerprint = name, fingerprint

    def save(self, iteration: int, parts: dict[str, Any], **meta: Any) -> None:
        """Keep ``parts`` (component name -> what ``capture`` takes) as of ``iteration`` done."""
        self.store.save(iteration, self.name, {name: capture(value) for name, value in parts.items()},
                        {"fingerprint": self.fingerprint, **meta})

    def load(self, iteration: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(meta, tree) of this writer's checkpoint of ``iteration``, checked to be this run's."""
        meta, tree = self.store.load(iteration, self.name)
        if meta.get("fingerprint") != self.fingerprint:
            raise CheckpointError(f"checkpoint {self.store.folder(iteration)} is of another configuration: resume a "
                                  "run with the configuration it was started with")
        return meta, tree

    def restore(self, tree: dict[str, Any], parts: dict[str, Any], device: torch.device | str = "cpu") -> dict:
        """Write ``tree``'s components into ``parts`` (as ``save`` was given them); returns the
        values restored (those not restored in place, such as a generator's state, to be applied)."""
        missing = sorted(set(parts) - set(tree))
        if missing:
            raise CheckpointError(f"checkpoint of {self.name} holds no {', '.join(missing)}: it is of another run")
        return {name: restore(value, tree[name], device, name) for name, value in parts.items()}
