"""User-space network emulation: correlated loss, delay and jitter, applied inside a transport.

Spec strings look like ``loss=20%,corr=25%,delay=200ms,jitter=50ms,rate=10mbit``. Loss follows a
two-state Markov chain whose stationary loss rate is exactly ``loss`` and whose lag-1 correlation
between successive drop decisions is ``corr`` (netem's "correlation" nudges a random number
instead, which shifts the real loss rate; this keeps it). Delays are normal(delay, jitter),
clipped at 0. ``rate`` limits each link (one sender to one receiver) to that many bits a second
(``LinkRate``): a message or datagram leaves after those queued before it on the link, and takes
its bytes x 8 / rate on the wire before its delay starts.

TCP cannot lose a message, only take longer: where the kernel cannot drop real packets (see
``meshlearn.sim.kernelnet``), ``Emulator.retransmit_delay`` models what loss costs TCP.
"""

from __future__ import annotations

import heapq
import random
import re
from typing import Any

import numpy as np
from pydantic import Field, model_serializer, model_validator

from meshlearn.errors import ConfigError
from meshlearn.settings import Settings
from meshlearn.suggest import closest

_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
RTO_MIN = 0.2  # seconds: Linux's minimum TCP retransmission timeout
SEGMENT_BYTES = 1448  # TCP payload of one 1,500-byte Ethernet frame
_KEYS = ("loss", "corr", "delay", "jitter", "rate")
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}  # tc's names: bits a second, powers of 1,000
_SYNTAX = "loss=P%, corr=P%, delay=Tms, jitter=Tms, rate=Nmbit"


class NetemSpec(Settings):
    """Emulated network conditions (the ``net`` setting). Written as a string such as
    ``loss=20%,corr=25%,delay=200ms,jitter=50ms`` (any subset, any order) or as a map of the fields."""

    loss: float = Field(0.0, ge=0, le=1, description="share of packets lost (0..1; 20% in the string form)")
    corr: float = Field(0.0, ge=0, le=1, description="lag-1 correlation between successive drop decisions (0..1)")
    delay: float = Field(0.0, ge=0, description="mean one-way delay per message or datagram, in seconds")
    jitter: float = Field(0.0, ge=0, description="standard deviation of the delay, in seconds")
    rate: float = Field(0.0, ge=0, description="bandwidth of each link, in bits a second (0: unlimited; "
                                               "10mbit in the string form)")

    @model_validator(mode="before")
    @classmethod
    def _from_string(cls, value: Any) -> Any:
        if value is None:
            return {}
        return cls._parse_fields(value) if isinstance(value, str) else value

    @model_serializer
    def _as_string(self) -> str:
        return self.describe() if self.active else ""

    @property
    def active(self) -> bool:
        return bool(self.loss or self.delay or self.jitter or self.rate)

    def without_loss(self) -> "NetemSpec":
        """The same conditions with loss left to someone else (the kernel)."""
        return self.model_copy(update={"loss": 0.0, "corr": 0.0})

    @classmethod
    def parse(cls, text: str | None) -> "NetemSpec":
        """Parse ``loss=20%,corr=25%,delay=200ms,jitter=50ms,rate=10mbit`` (any subset, any order)."""
        try:
            fields = cls._parse_fields(text or "")
        except ValueError as exc:
            raise ConfigError(str(exc), setting="net", value=text) from None
        return cls(**fields)

    @staticmethod
    def _parse_fields(text: str) -> dict[str, float]:
        values: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            if not sep or key.strip() not in _KEYS:
                meant = None if key.strip() in _KEYS else closest(key.strip(), _KEYS)
                raise ValueError(f"{item!r} is not one of {_SYNTAX}" + (f" (did you mean {meant}?)" if meant else ""))
            key = key.strip()
            parse = _percent if key in ("loss", "corr") else parse_rate if key == "rate" else _duration
            values[key] = parse(raw)
        return values

    def describe(self) -> str:
        """The spec written back in its own syntax."""
        text = (f"loss={self.loss * 100:g}%,corr={self.corr * 100:g}%,"
                f"delay={self.delay * 1000:g}ms,jitter={self.jitter * 1000:g}ms")
        return text + (f",rate={_bandwidth(self.rate)}" if self.rate else "")


def _percent(raw: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(%?)\s*", raw)
    value = float(match.group(1)) / (100 if match.group(2) else 1) if match else -1
    if not 0 <= value <= 1:
        raise ValueError(f"{raw!r} must be a share like 20% (0..100%)")
    return value


def _duration(raw: str) -> float:
    match = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|us)?\s*", raw)
    if not match:
        raise ValueError(f"{raw!r} must be a duration like 200ms")
    return float(match.group(1)) * _UNITS[match.group(2) or "ms"]


def parse_rate(raw: str) -> float:
    """Bits a second from a bandwidth in tc's units (``10mbit``, ``9.5mbit``, ``1gbit``); ValueError
    in one line for anything else."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?bit)\s*", raw.lower())
    value = float(match.group(1)) * _RATE_UNITS[match.group(2)] if match else 0.0
    if value <= 0:
        raise ValueError(f"{raw!r} must be a bandwidth like 10mbit "
                         "(bit, kbit, mbit or gbit a second)")
    return value


def _bandwidth(bits_per_second: float) -> str:
    """A rate in ``_rate``'s syntax, exactly: the largest unit that divides it."""
    for unit, size in sorted(_RATE_UNITS.items(), key=lambda item: -item[1]):
        if bits_per_second >= size and (bits_per_second / size).is_integer():
            return f"{int(bits_per_second / size)}{unit}"
    return f"{bits_per_second!r}bit"


class LinkRate:
    """Each link's emulated bandwidth (``NetemSpec.rate``, bits a second), as a clock per link: a
    message or datagram of ``nbytes`` starts when the link is free (those before it on the same link
    have left) and is through ``nbytes x 8 / rate`` later. Links (``key``: a peer's rank or address)
    are independent: a node's links do not share an uplink. Pure: the caller gives the time."""

    def __init__(self, bits_per_second: float):
        if bits_per_second <= 0:
            raise ValueError("a link rate is a positive number of bits a second")
        self.seconds_per_byte = 8.0 / bits_per_second
        self._free: dict[Any, float] = {}  # link -> when it has sent everything queued on it

    def through(self, key: Any, nbytes: int, now: float) -> float:
        """When ``nbytes`` handed to link ``key`` at ``now`` are through it (and the link free again)."""
        done = max(now, self._free.get(key, now)) + nbytes * self.seconds_per_byte
        self._free[key] = done
        return done


class Emulator:
    """Draws drop decisions and delays for one sender, seeded for reproducibility."""

    def __init__(self, spec: NetemSpec, seed: int):
        self.spec = spec
        self.rng = random.Random(seed)
        # Markov chain: P(drop | dropped last) = a, P(drop | passed last) = b.
        self._b = spec.loss * (1 - spec.corr)
        self._a = spec.corr + self._b
        self._last_dropped = self.rng.random() < spec.loss

    def drop(self) -> bool:
        """Whether the next packet is lost."""
        if not self.spec.loss:
            return False
        threshold = self._a if self._last_dropped else self._b
        self._last_dropped = self.rng.random() < threshold
        return self._last_dropped

    def delay(self) -> float:
        """Seconds to hold the next packet."""
        if not (self.spec.delay or self.spec.jitter):
            return 0.0
        return max(0.0, self.rng.gauss(self.spec.delay, self.spec.jitter))

    def retransmit_delay(self, nbytes: int) -> float:
        """Extra seconds TCP would need to deliver ``nbytes`` over a path losing ``loss`` of its
        packets (``retransmit_delays``' model, for one message)."""
        if not self.spec.loss:
            return 0.0
        return float(retransmit_delays(self.spec.loss, nbytes, np.array([self.rng.random()]))[0])


def retransmit_delays(loss: float, nbytes: int, uniform: np.ndarray) -> np.ndarray:
    """Extra seconds TCP needs to deliver a message of ``nbytes`` over a path losing ``loss`` of
    its packets, one per draw of ``uniform`` (uniform numbers in [0, 1)).

    A coarse model, used where real packets cannot be dropped: the message is cut into
    Ethernet-sized segments, each lost independently. A segment's first loss is repaired by fast
    retransmit (SACK) within about one round trip, taken as free; each further loss of the same
    segment costs a retransmission timeout, doubling each time (RTO_MIN, 2 RTO_MIN, ...). The
    worst segment sets the delay, since the others are repaired meanwhile. Tail losses and
    congestion-window shrinkage are ignored, so this errs short; benchmarks/RESULTS.md compares it
    with real kernel drops.
    """
    uniform = np.asarray(uniform, dtype=np.float64)
    if not loss:
        return np.zeros_like(uniform)
    if loss >= 1:
        return np.full_like(uniform, np.inf)
    segments = max(1, -(-nbytes // SEGMENT_BYTES))
    # P(the worst segment is lost at most k times), k = 0..12 (12: the last, open-ended class)
    cdf = (1 - loss ** np.arange(1, 13, dtype=np.float64)) ** segments
    worst = np.minimum(np.searchsorted(cdf, uniform, side="left"), 12)
    return np.where(worst > 1, RTO_MIN * (2.0 ** (worst - 1) - 1), 0.0)


class DelayLine:
    """Items held back by an emulated delay until they are due (a heap; not thread-safe).

    With ``keep_order`` an item is never due before one pushed earlier with the same ``key`` (TCP
    delivers in order on each connection); without it, jitter may reorder items (datagrams), as a
    real network may.
    """

    def __init__(self, keep_order: bool = False):
        self.keep_order = keep_order
        self._heap: list[tuple[float, int, Any]] = []
        self._pushed = 0
        self._last_due: dict[Any, float] = {}  # key -> the latest due time pushed with it

    def push(self, item: Any, due: float, key: Any = None) -> float:
        """Hold ``item`` until ``due`` (a clock reading); returns when it will really be due."""
        if self.keep_order:
            due = self._last_due[key] = max(self._last_due.get(key, due), due)
        self._pushed += 1
        heapq.heappush(self._heap, (due, self._pushed, item))
        return due

    def pop_due(self, now: float) -> list[Any]:
        """Every item due at ``now``, in the order they fall due."""
        due = []
        while (item := self.pop_next(now)) is not None:
            due.append(item)
        return due

    def pop_next(self, now: float) -> Any | None:
        """The first item, if it is due at ``now``."""
        return heapq.heappop(self._heap)[2] if self._heap and self._heap[0][0] <= now else None

    def next_due(self) -> float | None:
        """When the next item falls due, or None if none is held."""
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)
