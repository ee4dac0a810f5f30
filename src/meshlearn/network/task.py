"""A training task: the requester's validated request, and the spec every provider of it receives."""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from meshlearn.errors import UserInputError
from meshlearn.network.envelope import BadMessage

MAX_EPOCHS = 1000
DEFAULT_BATCH = 16
DEFAULT_LR = 0.001
MAX_TASK_PEERS = 256
WEIGHTS_FILE = "initial.safetensors"  # the name initial weights are served under
DATASET_PREFIXES = ("digits", "fashion-mnist:", "mnist:", "cifar10:", "imagefolder:")


@dataclass
class TaskRequest:
    """What the user asked for, after the corrections the rules allow (see ``validate_request``)."""

    data: str
    model: str = "simplecnn"
    epochs: int = 10
    batch_size: int = DEFAULT_BATCH
    lr: float = 0.01
    momentum: float = 0.0
    providers: int = 4
    device: str = "any"
    location: str | None = None
    algorithm: str = "leader"
    aggregate_every: int | Literal["epoch"] = "epoch"
    data_on_providers: str | None = None
    seed: int = 90
    partition: str = "iid"
    eval_samples: int = 0
    peer_timeout: float = 20.0
    weights: str | None = None  # a local safetensors file of initial weights
    warnings: list[str] = field(default_factory=list)


def dataset_spec(data: str) -> str:
    """A dataset spec from ``--data``: a spec meshlearn knows, a folder with train/ and test/, or CIFAR's archive."""
    if data == "digits" or data.startswith(DATASET_PREFIXES[1:]):
        return data
    path = Path(data)
    if path.is_dir() and (path / "train").is_dir() and (path / "test").is_dir():
        return f"imagefolder:{path.resolve()}"
    if path.is_file() and path.name.startswith("cifar") and path.name.endswith((".tar.gz", ".tgz")):
        return f"cifar10:{path.resolve()}"
    if path.is_dir() and (path / "data_batch_1").exists():
        return f"cifar10:{path.resolve()}"
    if not path.exists():
        raise UserInputError(f"data path {data} does not exist: give a folder with train/ and test/, "
                             "or a dataset such as digits or cifar10:PATH")
    raise UserInputError(f"data path {data} holds no train/ and test/ folders: give an ImageFolder tree "
                         "(train/<class>/*, test/<class>/*) or a dataset such as digits")


def validate_request(values: dict[str, Any], train_samples: int | None = None) -> TaskRequest:
    """Check and correct a request before anything starts; corrections are listed in ``warnings``.

    Batch size outside [1, n] becomes 16, a learning rate <= 0 becomes 0.001, epochs are rounded
    and clipped to 1..MAX_EPOCHS. Anything that cannot be corrected raises UserInputError.
    """
    req = TaskRequest(data=str(values.get("data") or values.get("data_on_providers") or ""))
    if not req.data:
        raise UserInputError("no data: pass --data PATH (a folder with train/ and test/), a dataset such as "
                             "digits, or --data-on-providers SPEC")
    warnings = req.warnings
    for key in ("model", "algorithm", "device", "location", "data_on_providers", "partition"):
        if values.get(key) is not None:
            setattr(req, key, str(values[key]))
    if req.algorithm not in ("leader", "dpsgd", "gossip"):
        raise UserInputError(f"algorithm {req.algorithm!r} is not leader, dpsgd or gossip")
    if req.device not in ("any", "gpu", "cuda", "mps", "cpu"):
        raise UserInputError(f"device {req.device!r} is not any, gpu, mps or cpu")
    if values.get("weights"):
        req.weights = check_weights_file(str(values["weights"]))
    req.seed = _integer(values.get("seed", req.seed), "seed", minimum=0)
    req.providers = _integer(values.get("providers", req.providers), "providers", minimum=1)
    req.eval_samples = _integer(values.get("eval_samples", 0), "eval samples", minimum=0)
    req.peer_timeout = _number(values.get("peer_timeout", req.peer_timeout), "peer timeout")
    if req.peer_timeout <= 0:
        raise UserInputError("peer timeout must be more than 0 seconds")

    epochs = _number(values.get("epochs", req.epochs), "epochs")
    if not math.isfinite(epochs):
        raise UserInputError("epochs must be a finite number")
    rounded = min(MAX_EPOCHS, max(1, round(epochs)))
    if rounded != epochs:
        warnings.append(f"epochs {epochs:g} became {rounded} (a whole number in 1..{MAX_EPOCHS})")
    req.epochs = rounded

    batch = _number(values.get("batch_size", req.batch_size), "batch size")
    upper = train_samples if train_samples else math.inf
    if batch != int(batch) or not 1 <= batch <= upper:
        warnings.append(f"batch size {batch:g} is outside [1, {upper}]: using {DEFAULT_BATCH}")
        batch = DEFAULT_BATCH
    req.batch_size = int(batch)

    lr = _number(values.get("lr", req.lr), "learning rate")
    if not lr > 0 or not math.isfinite(lr):
        warnings.append(f"learning rate {lr:g} must be more than 0: using {DEFAULT_LR}")
        lr = DEFAULT_LR
    req.lr = lr

    req.momentum = _number(values.get("momentum", req.momentum), "momentum")
    if not 0 <= req.momentum < 1:
        raise UserInputError(f"momentum must be in [0, 1) (got {req.momentum:g})")

    every = values.get("aggregate_every", "epoch")
    if str(every) == "epoch":
        req.aggregate_every = "epoch"
    else:
        req.aggregate_every = _integer(every, "aggregate-every (a number of batches, or epoch)", minimum=1)
    return req


def check_weights_file(path: str) -> str:
    """The absolute path of a readable safetensors file of tensors; UserInputError says what is wrong."""
    from safetensors import SafetensorError, safe_open

    file = Path(path)
    if not file.is_file():
        raise UserInputError(f"weights file {path} does not exist: give a .safetensors file of the model's state")
    try:
        with safe_open(str(file), framework="pt") as handle:
            if not list(handle.keys()):
                raise UserInputError(f"weights file {path} holds no tensors")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserInputError(f"weights file {path} is not a safetensors file ({exc}): save it with "
                             "safetensors.torch.save_file(model.state_dict(), PATH)") from None
    return str(file.resolve())


def _number(value: Any, what: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserInputError(f"{what} {value!r} is not a number") from None


def _integer(value: Any, what: str, minimum: int) -> int:
    number = _number(value, what)
    if number != int(number) or number < minimum:
        raise UserInputError(f"{what} must be a whole number of at least {minimum} (got {value!r})")
    return int(number)


def new_task_id() -> str:
    return uuid.uuid4().hex[:12]


class Peer(BaseModel):
    """A provider of the task, in leader-election order (index 0 leads first)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(max_length=64)
    address: str = Field(max_length=256)


class ServedFile(BaseModel):
    """A file the requester serves (initial weights): where to fetch it, its size and SHA-256."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(max_length=256)
    size: int = Field(ge=1, le=1 << 36)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class TaskSpec(BaseModel):
    """Everything a provider needs to run its part of a task; sent as JSON, validated on arrival."""

    model_config = ConfigDict(extra="forbid")
    task_id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    model: str = Field(max_length=64)
    epochs: int = Field(ge=1, le=MAX_EPOCHS)
    batch_size: int = Field(ge=1)
    lr: float = Field(gt=0)
    momentum: float = Field(0.0, ge=0, lt=1)
    algorithm: Literal["leader", "dpsgd", "gossip"]
    aggregate_every: int | Literal["epoch"]
    seed: int = Field(ge=0)
    partition: str = Field(max_length=64)
    eval_samples: int = Field(ge=0)
    peer_timeout: float = Field(gt=0, le=3600)
    peers: list[Peer] = Field(min_length=1, max_length=MAX_TASK_PEERS)
    data: dict[str, Any]  # {"mode": "served", "address", "files"} or {"mode": "local", "dataset"}
    meta: dict[str, Any] | None = None  # classes and normalization (served mode)
    weights: ServedFile | None = None  # initial weights, served by the requester
    requester: str = Field("", max_length=256)

    @classmethod
    def parse(cls, body: dict) -> "TaskSpec":
        """Validate a spec from the network; BadMessage names the first problem."""
        try:
            return cls(**body)
        except ValidationError as exc:
            err = exc.errors()[0]
            raise BadMessage(f"task spec: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
        except TypeError:
            raise BadMessage("task spec is not a JSON object of settings") from None
