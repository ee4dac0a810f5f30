"""Who may act on a task at a provider: the key that claimed it, and the providers it was given.

Admission (the network secret) lets a key into the network; it does not let it act on other
people's tasks. When a provider accepts a task it records the requester's key (the one that
sent ``task.assign``, checked against the bootstrap's record of the claim) and the key of each
provider of the task (from the spec's pinned addresses, which the bootstrap vouched for), and
keeps them beside the task's result, so they still hold once the run is over or the provider
restarted. Every task-scoped request is then checked against the key its channel proved.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from meshlearn.errors import BadMessage
from meshlearn.network.channel.identity import key_in
from meshlearn.network.task.spec import TaskSpec

ACCESS_FILE = "access.json"


@dataclass(frozen=True)
class TaskAccess:
    """The keys of one task: its requester's, and its providers' by index (as printed)."""

    task: str
    requester: str
    providers: tuple[str, ...]

    @classmethod
    def of(cls, spec: TaskSpec, requester: str) -> "TaskAccess":
        return cls(spec.task_id, requester, tuple(key_in(p.address) for p in spec.peers))

    def require_requester(self, key: str, what: str) -> None:
        """Refuse ``what`` unless ``key`` claimed the task."""
        if not key or key != self.requester:
            raise BadMessage(f"{what} refused: task {self.task} is not one this key requested")

    def provider_index(self, key: str, what: str, claimed: int | None = None) -> int:
        """The index of the task's provider holding ``key`` (refusing ``what`` for any other key,
        or if the request names another provider's index, ``claimed``)."""
        index = self.providers.index(key) if key and key in self.providers else None
        if index is None or (claimed is not None and claimed != index):
            raise BadMessage(f"{what} refused: this key is not "
                             + ("a provider of" if index is None else f"provider {claimed} of") + f" task {self.task}")
        return index

    def require_member(self, key: str, what: str) -> None:
        """Refuse ``what`` unless ``key`` is the task's requester or one of its providers."""
        if not key or (key != self.requester and key not in self.providers):
            raise BadMessage(f"{what} refused: this key has no part in task {self.task}")

    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ACCESS_FILE).write_text(json.dumps(
            {"task": self.task, "requester": self.requester, "providers": list(self.providers)}))

    @classmethod
    def load(cls, folder: Path) -> "TaskAccess | None":
        """The access kept in ``folder`` (None if there is none, or it is not one)."""
        try:
            kept = json.loads((folder / ACCESS_FILE).read_text())
            return cls(str(kept["task"]), str(kept["requester"]), tuple(str(k) for k in kept["providers"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
