"""Numbers read from the metadata a peer sent with a message (a JSON object), checked: a message's
metadata comes from peers, so a value that is not what it should be reads as None. The transports,
the process engine's runtimes and the algorithm layer's state machines (a gossiping node's view of
its peer's clock and loss, in both engines) read them here."""

from __future__ import annotations

import math
from typing import Any


def meta_number(meta: dict[str, Any], key: str, default: float | None = 0.0) -> float | None:
    """The non-negative finite number a message's metadata holds under ``key`` (``default`` when
    absent), or None when it holds anything else: metadata comes from peers, so check it."""
    value = meta_real(meta, key, default)
    return None if value is None or value < 0 else value


def meta_real(meta: dict[str, Any], key: str, default: float | None = 0.0) -> float | None:
    """The finite number (of either sign) a message's metadata holds under ``key`` (``default``
    when absent), or None when it holds anything else (null, a string, a bool, NaN)."""
    value = meta.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)
