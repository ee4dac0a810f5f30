"""What a population's clients keep between the rounds they are drawn for, kept only for those that
have any: a sparse store of small named arrays per client (a loader's place in its stream, a
client's own momentum), held in memory up to a budget and spilled to files beyond it.

A cross-device population (10^4 to 10^6 clients, a cohort of 10^2 to 10^3 a round) has no model
row per client in the batched engine: a client exists while drawn (``batched.cohort``). What a
client must carry from one draw to its next lives here, keyed by its rank, and costs nothing for
the clients never drawn. Entries are written back whole after each round; the least recently used
ones leave memory first, for a file of their own in ``spill`` (raw ``.npy`` arrays: numpy reads
them back without unpickling anything).
"""

from __future__ import annotations

import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from meshlearn.checkpoint import CheckpointError, Stateful, capture, decode

DEFAULT_BUDGET = 512 * 2 ** 20  # bytes of client state held in memory before the oldest entries spill to disk
Entry = dict[str, np.ndarray]


def entry_bytes(entry: Entry) -> int:
    """Bytes of one client's arrays."""
    return sum(array.nbytes for array in entry.values())


class ClientStates(Stateful):
    """Per-client named arrays, for the clients that have any. ``budget``: bytes kept in memory; the
    entries used longest ago beyond it go to files in ``spill`` (a folder made on first need, a
    temporary one by default; either is removed by ``close``, with what this store wrote in it). ``get`` reads a client's entry back from
    wherever it is; ``put`` replaces it. A checkpoint keeps every entry (``state_dict``)."""

    def __init__(self, budget: int = DEFAULT_BUDGET, spill: str | Path | None = None):
        if budget < 0:
            raise ValueError("a client-state budget is a number of bytes, at least 0")
        self.budget = budget
        self._spill_root = Path(spill) if spill is not None else None
        self._spill_dir: Path | None = None
        self._owned = False  # whether the spill folder is ours to remove (a temporary one)
        self._memory: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self._held = 0  # bytes in memory
        self._spilled: set[int] = set()

    def __len__(self) -> int:
        return len(self._memory) + len(self._spilled)

    def __contains__(self, client: int) -> bool:
        return client in self._memory or client in self._spilled

    @property
    def held_bytes(self) -> int:
        """Bytes of client state in memory now."""
        return self._held

    @property
    def spilled(self) -> int:
        """How many clients' entries are on disk now."""
        return len(self._spilled)

    def get(self, client: int) -> Entry | None:
        """Client ``client``'s arrays (None: it has none), brought back into memory if spilled."""
        entry = self._memory.get(client)
        if entry is not None:
            self._memory.move_to_end(client)
            return entry
        if client not in self._spilled:
            return None
        entry = self._read(client)
        self._spilled.discard(client)
        self._file(client).unlink(missing_ok=True)
        self._keep(client, entry)
        return entry

    def put(self, client: int, entry: Entry) -> None:
        """Client ``client``'s arrays from now on (copies are not made: give arrays of its own)."""
        self.drop(client)
        self._keep(client, {name: np.ascontiguousarray(array) for name, array in entry.items()})

    def drop(self, client: int) -> None:
        """Forget client ``client``'s arrays."""
        old = self._memory.pop(client, None)
        if old is not None:
            self._held -= entry_bytes(old)
        if client in self._spilled:
            self._spilled.discard(client)
            self._file(client).unlink(missing_ok=True)

    def _keep(self, client: int, entry: Entry) -> None:
        self._memory[client] = entry
        self._held += entry_bytes(entry)
        while self._held > self.budget and len(self._memory) > 1:  # the entry just used stays
            oldest, spilled = self._memory.popitem(last=False)
            self._held -= entry_bytes(spilled)
            self._write(oldest, spilled)

    # --- the spill folder -----------------------------------------------------------------------

    def _folder(self) -> Path:
        if self._spill_dir is None:
            if self._spill_root is None:
                self._spill_dir, self._owned = Path(tempfile.mkdtemp(prefix="meshlearn-clients-")), True
            else:
                self._spill_root.mkdir(parents=True, exist_ok=True)
                self._spill_dir, self._owned = self._spill_root, True
        return self._spill_dir

    def _file(self, client: int) -> Path:
        return self._folder() / f"client-{client}.npz"

    def _write(self, client: int, entry: Entry) -> None:
        with self._file(client).open("wb") as handle:
            np.savez(handle, **entry)
        self._spilled.add(client)

    def _read(self, client: int) -> Entry:
        with np.load(self._file(client), allow_pickle=False) as stored:
            return {name: stored[name] for name in stored.files}

    def close(self) -> None:
        """Remove the spill folder and its files (the store is done with)."""
        if self._owned and self._spill_dir is not None:
            shutil.rmtree(self._spill_dir, ignore_errors=True)
            self._spill_dir, self._owned = None, False
        self._spilled.clear()

    # --- checkpoints ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Every client's entry (spilled ones read back, without moving them), by client rank."""
        entries = {}
        for client in sorted(self._memory.keys() | self._spilled):
            entry = self._memory.get(client)
            entries[str(client)] = entry if entry is not None else self._read(client)
        return {"entries": capture(entries)}

    def load_state(self, state: dict[str, Any], device: str = "cpu") -> None:
        """Every entry of a checkpoint's ``state_dict``, in place of those held now."""
        entries = decode(state.get("entries"), "cpu", "ClientStates.entries") if isinstance(state, dict) else None
        if not isinstance(entries, dict) or not all(
                str(client).isdigit() and isinstance(entry, dict)
                and all(isinstance(array, np.ndarray) for array in entry.values())
                for client, entry in entries.items()):
            raise CheckpointError("the checkpoint's client states are damaged: it is not of this run's kind")
        for client in list(self._memory.keys() | self._spilled):
            self.drop(client)
        for client, entry in entries.items():
            self.put(int(client), {name: np.array(array, copy=True) for name, array in entry.items()})
