"""The base of every request and reply body, and the bounded field types they are made of.

A message is a frozen pydantic model: strict types (no "5" for 5, no 1 for True), no field it does
not declare, every string, list and free-form object bounded. The server validates a request's
body into its model before any handler runs (``rpcs.serve``), and a client validates a reply's
(``stub.ask``); a body that does not fit is refused in one line naming the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from meshlearn.errors import BadMessage

FREE_FORM_BYTES = 32 * 1024 * 1024  # the largest free-form object (a run's metrics, its history) a message may carry
FREE_FORM_DEPTH = 8  # and its deepest nesting


class Message(BaseModel):
    """A request's or a reply's body: declared fields only, strictly typed, frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    @classmethod
    def read(cls, body: Any, what: str) -> "Message":
        """``body`` as this message, or BadMessage naming ``what`` and the first field that does not fit."""
        try:
            return cls.model_validate(body)
        except ValidationError as exc:
            raise BadMessage(f"{what}: {first_problem(exc)}") from None

    def body(self) -> dict[str, Any]:
        """The JSON object that travels."""
        return self.model_dump(mode="json")


class Empty(Message):
    """A body with nothing in it."""


def first_problem(exc: ValidationError) -> str:
    """A validation error in one line: the first field that does not fit, and why."""
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the body"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"field {where!r}: {error['msg']}{more}"


def _bounded_object(value: dict[str, Any]) -> dict[str, Any]:
    """A free-form JSON object within FREE_FORM_BYTES and FREE_FORM_DEPTH."""

    def depth(item: Any, level: int) -> None:
        if level > FREE_FORM_DEPTH:
            raise ValueError(f"nested deeper than {FREE_FORM_DEPTH} levels")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            depth(child, level + 1)

    depth(value, 1)
    if len(json.dumps(value)) > FREE_FORM_BYTES:
        raise ValueError(f"larger than {FREE_FORM_BYTES} bytes of JSON")
    return value


Id = Annotated[str, StringConstraints(min_length=1, max_length=64)]  # a provider's or a task's id
TaskId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
Address = Annotated[str, StringConstraints(min_length=1, max_length=256)]  # HOST:PORT, or HOST:PORT@KEY
Key = Annotated[str, StringConstraints(min_length=1, max_length=64)]  # a public key as printed
Token = Annotated[str, StringConstraints(min_length=1, max_length=64)]
ShortText = Annotated[str, StringConstraints(max_length=256)]
Count = Annotated[int, Field(ge=0, lt=1 << 31)]
Round = Annotated[int, Field(gt=0, lt=1 << 31)]  # a round number, counted from 1
Real = Annotated[float, Field(allow_inf_nan=False)]
FreeForm = Annotated[dict[str, Any], AfterValidator(_bounded_object)]  # metrics, status: JSON, bounded
Device = Literal["cuda", "mps", "cpu"]
Status = Literal["free", "busy", "leaving"]
