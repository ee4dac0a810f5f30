"""The leader algorithm's endpoint: members push their model to the leader and get its aggregate back.

Built on ``transport.served``. Every member binds one (any member may come to lead); the serving
thread hands each request to the algorithm's ``Responder``, which answers it at once (a ping, a
push the leader can aggregate now) or holds it (a push that must wait for the others: the first
cycle, the final models). Held pushes cost no thread: the serving thread asks the responder
again whenever it is poked, a request arrives, or ``POLL_MS`` passes, and answers those whose
time has come. A push sent again (its first copy, or the answer, may have been lost on the way)
replaces the one held for its member, so the answer goes to the request the member waits on. A
closing hub answers what it holds with ``{"status": "closing"}``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

import torch

from meshlearn.transport.served import Held, ServedEndpoint
from meshlearn.transport.settings import TcpSettings
from meshlearn.wire import Message
from meshlearn.wire.sealed import FrameSeal


@dataclass
class Answer:
    """What a request gets back: tensors (a model, or none) and metadata."""

    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)


class Responder(Protocol):
    """Decides the answers of a hub (called from its serving thread only)."""

    def respond(self, request: Message) -> Answer | None:
        """The answer to a valid request from a peer, or None to hold it."""

    def release(self, held: list[int]) -> dict[int, Answer]:
        """Answers for those of the held requests (by sender) that can be answered now."""


CLOSING = Answer(meta={"status": "closing"})


class HubEndpoint(ServedEndpoint):
    """A member's endpoint for leader aggregation: serves pushes and pings, makes its own through callers."""

    def __init__(self, node_id: int, host: str = "127.0.0.1", port: int = 0, *, settings: TcpSettings | None = None,
                 secret: bytes | None = None, seal: FrameSeal | None = None):
        super().__init__(node_id, host, port, settings=settings, secret=secret, seal=seal)
        self.responder: Responder | None = None

    def serve(self, responder: Responder) -> None:
        """Say who answers requests (before ``connect``)."""
        self.responder = responder

    def _on_request(self, routing_id: Any, request: Message, held: dict[int, Held]) -> None:
        answer = self.responder.respond(request) if self.responder is not None else CLOSING
        if answer is None:
            held[request.sender] = Held(routing_id, request.iteration, math.inf)
        else:
            self._reply(routing_id, request.iteration, answer.tensors, answer.meta)

    def _answer_held(self, held: dict[int, Held], closing: bool) -> None:
        if not held:
            return
        answers = {} if self.responder is None else self.responder.release(list(held))
        for sender in list(held):
            answer = answers.get(sender) or (CLOSING if closing else None)
            if answer is not None:
                request = held.pop(sender)
                self._reply(request.routing_id, request.request_id, answer.tensors, answer.meta)
