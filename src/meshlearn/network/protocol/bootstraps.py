"""The bootstraps a peer knows, and which one it asks: a network of several bootstraps sharing one
registry answers from any of them, so a peer that loses one moves to the next within the call.

``--bootstrap`` lists them, comma-separated, each ``HOST:PORT@KEY``. A request goes to the bootstrap
that answered last; where it does not answer (its process is gone: refused at once; cut off: after
the call's timeout), or answers that its registry has no majority behind it (``ServiceUnavailable``),
the same request goes to the next, and round the list again for a few seconds while none serves
(the cluster behind them elects a new leader). A request whose answer was lost
may have been carried out: every bootstrap request is one that can be sent again (a claim names its
attempt, so a claim sent twice claims once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from meshlearn.errors import ServiceUnavailable, Unreachable, UserInputError
from meshlearn.network.channel.identity import split_pinned
from meshlearn.network.protocol.message import Message
from meshlearn.network.protocol.rpcs import Rpc
from meshlearn.network.protocol.serving import ask

log = logging.getLogger(__name__)
MAX_BOOTSTRAPS = 16  # a network's bootstraps a peer may list (3 or 5 is the rule)
FAILOVER_WITHIN = 10.0  # seconds a request to a network of several bootstraps keeps going round them
ROUND_PAUSE = 0.5  # seconds between two rounds (none served: a new leader is being elected)


class Bootstraps:
    """The bootstraps of one network, as ``--bootstrap`` lists them, and the one asked now."""

    def __init__(self, addresses: Sequence[str]):
        if not addresses:
            raise UserInputError("--bootstrap names no bootstrap: give HOST:PORT@KEY[,HOST:PORT@KEY...]")
        if len(addresses) > MAX_BOOTSTRAPS:
            raise UserInputError(f"--bootstrap lists {len(addresses)} bootstraps: at most {MAX_BOOTSTRAPS}")
        self.addresses = tuple(addresses)
        self._current = 0
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, text: str) -> Bootstraps:
        """``--bootstrap`` as given: one address, or several comma-separated."""
        return cls([part.strip() for part in text.split(",") if part.strip()])

    @property
    def current(self) -> str:
        """The address asked first now: the one that answered last."""
        return self.addresses[self._current]

    @property
    def text(self) -> str:
        """Every address, comma-separated (as ``--bootstrap`` takes them)."""
        return ",".join(self.addresses)

    def keys(self) -> list[str]:
        """The keys the bootstraps are pinned to (their relays and dial-backs prove them)."""
        return [key for key in (split_pinned(a)[1] for a in self.addresses) if key is not None]

    def ask(self, rpc: Rpc, message: Message, secret: bytes, **options: Any) -> Any:
        """``serving.ask`` to the current bootstrap, then to each other one in turn while the one asked
        does not answer or has no majority behind its registry. A network of several goes round
        again for up to FAILOVER_WITHIN seconds (its cluster elects a new leader meanwhile); the
        last error where none could serve."""
        started = time.monotonic()
        while True:
            try:
                return self._round(rpc, message, secret, options)
            except (Unreachable, ServiceUnavailable):
                if len(self.addresses) == 1 or time.monotonic() - started >= FAILOVER_WITHIN:
                    raise
            time.sleep(ROUND_PAUSE)

    def _round(self, rpc: Rpc, message: Message, secret: bytes, options: dict) -> Any:
        """Once round the list, from the current bootstrap; the first answer (it becomes current)."""
        start = self._current
        error: Exception | None = None
        for step in range(len(self.addresses)):
            index = (start + step) % len(self.addresses)
            try:
                reply = ask(self.addresses[index], rpc, message, secret, **options)
            except (Unreachable, ServiceUnavailable) as exc:
                error = exc
                if len(self.addresses) > 1:
                    log.info("bootstrap %s did not serve %s (%s); asking the next", self.addresses[index], rpc.name,
                             exc)
                continue
            if index != start:
                with self._lock:
                    self._current = index
                log.info("moved to bootstrap %s", self.addresses[index])
            return reply
        assert error is not None
        raise error
