"""Pull exchange for gossip: every node serves its latest published state to any peer that asks,
from a background thread, and fetches one peer's state at a time without blocking training.

Built on ``transport.served``: each fetch is a REQUEST answered by a REPLY carrying the state
and its ``clock`` and ``loss`` in the message metadata, made by one fetch thread. A peer that
answers late costs the timeout; a dead peer fails the fetch at once.

A request may ask the server to *hold* it for up to ``wait`` seconds (its metadata): the server
answers with the last state it publishes within the wait (when it publishes a newer state and
does not expect to publish another before the wait ends, judging by its recent publications), or
with the state it has when the wait ends. A fetcher that asks when its own step starts and needs
the answer when the step ends thus gets the newest state its peer finishes in the meantime, not
one that is already a step old. Held requests are kept one per peer (a newer request from the
same peer replaces an unanswered one), never longer than ``MAX_HOLD``, and answered when the
server closes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping

import torch

from meshlearn.errors import TransportError, WireError
from meshlearn.meta import meta_number
from meshlearn.transport.served import SMALL_REQUEST_BYTES, Caller, Held, ServedEndpoint
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Message
from meshlearn.wire.sealed import FrameSeal

MAX_HOLD = 10.0  # seconds a server holds a request for a newer state, whatever the request asks


class PullEndpoint(ServedEndpoint):
    """A node's gossip endpoint: ``publish`` what peers may take, ``fetch`` from one peer."""

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *, settings: TcpSettings | None = None,
                 secret: bytes | None = None, seal: FrameSeal | None = None):
        super().__init__(node_id, host, port, settings=settings, secret=secret, max_request_bytes=SMALL_REQUEST_BYTES,
                         seal=seal)
        self.requests_held = 0  # requests that asked to wait for a newer state
        self.held_fresh = 0  # held requests answered with a state published while they waited
        self.held_expired = 0  # ... and those answered with an older one when their wait ended
        self._published: tuple[dict, dict] | None = None  # the latest state and its metadata
        self._version = 0  # publications so far
        self._last_publish = 0.0
        self._publish_interval = 0.0  # a moving average of the time between publications
        self._lock = threading.Lock()
        self._fetcher: ThreadPoolExecutor | None = None
        self._caller: Caller | None = None  # used by the fetch thread only

    @property
    def fetches(self) -> int:
        return self._caller.calls if self._caller else 0

    @property
    def fetch_timeouts(self) -> int:
        return self._caller.failures if self._caller else 0

    @property
    def fetch_refusals(self) -> int:
        """Fetches whose request or answer was damaged on the way (they end at once, with nothing)."""
        return self._caller.refusals if self._caller else 0

    def connect(self, peers: Mapping[int, str]) -> None:
        super().connect(peers)
        if self._fetcher is None:
            self._caller = self.caller()
            self._fetcher = ThreadPoolExecutor(1, thread_name_prefix=f"gossip-fetch-{self.node_id}")

    def publish(self, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, float]) -> None:
        """Make this state what peers get from now on. The tensors must not change afterwards
        (pass a private copy): they may still be on their way to a peer."""
        state = (dict(tensors), dict(meta))
        with self._lock:
            self._published = state
            self._version += 1
            now = time.monotonic()
            if self._last_publish:
                since = now - self._last_publish
                self._publish_interval = 0.8 * self._publish_interval + 0.2 * since if self._publish_interval else since
            self._last_publish = now
        self.poke()  # held requests may now be answered

    def fetch(self, peer: int, timeout: float, wait: float = 0.0) -> Future:
        """Start fetching ``peer``'s state; the future gives its Message, or None after ``timeout``
        seconds, on a refused or dead peer, if the request or answer was damaged on the way, or if
        it has published nothing yet. With ``wait`` > 0 the peer answers with the newest state it
        publishes within ``wait`` seconds, if any, else with the one it has when the wait ends."""
        if self._fetcher is None:
            raise TransportError("connect() must be called before fetch()")
        return self._fetcher.submit(self._fetch, peer, timeout, wait)

    def _fetch(self, peer: int, timeout: float, wait: float) -> Message | None:
        reply = self._caller.call(peer, timeout, meta={"wait": round(wait, 6)} if wait > 0 else None)
        return reply if reply is not None and reply.tensors else None

    def extra_stats(self) -> dict[str, int]:
        return {"requests_served": self.requests_served, "fetches": self.fetches, "fetch_timeouts": self.fetch_timeouts,
                "fetch_refusals": self.fetch_refusals, "requests_held": self.requests_held,
                "held_fresh": self.held_fresh, "held_expired": self.held_expired}

    def _before_close(self) -> None:
        if self._fetcher is not None:
            self._fetcher.shutdown(wait=True, cancel_futures=True)  # a fetch in flight ends at its timeout
            self._fetcher = None

    # --- the serving thread ----------------------------------------------------------------

    def _on_request(self, routing_id: Any, request: Message, held: dict[int, Held]) -> None:
        wait = _requested_wait(request.meta)
        if wait > 0:
            with self._lock:
                version = self._version
            held[request.sender] = Held(routing_id, request.iteration, time.monotonic() + wait, tag=version)
            self.requests_held += 1
        else:
            self._answer(routing_id, request.iteration)

    def _answer_held(self, held: dict[int, Held], closing: bool) -> None:
        if not held:
            return
        with self._lock:
            version, next_publish = self._version, self._last_publish + self._publish_interval
        now = time.monotonic()
        # Answer a request when its wait is over, or when it can have a newer state and the next one
        # is not expected in time; otherwise keep it for that next one.
        for peer in [peer for peer, h in held.items()
                     if closing or h.deadline <= now or (h.tag < version and next_publish >= h.deadline)]:
            request = held.pop(peer)
            if request.tag < version:
                self.held_fresh += 1
            else:
                self.held_expired += 1
            self._answer(request.routing_id, request.request_id)

    def _answer(self, routing_id: Any, request_id: int) -> None:
        with self._lock:
            published = self._published
        tensors, meta = published or ({}, {})
        self._reply(routing_id, request_id, tensors, meta)


def _requested_wait(meta: dict) -> float:
    """How long a request asks to be held (0: answer now), at most ``MAX_HOLD``."""
    wait = meta_number(meta, "wait")
    if wait is None:
        raise WireError(f"a request's wait must be a non-negative number of seconds, not {meta['wait']!r}")
    return min(wait, MAX_HOLD)
