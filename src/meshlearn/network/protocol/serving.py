"""Typed requests over the channel: servers register a handler per declaration, clients ask with a
declaration and a request model.

``serve`` builds a server's dispatch table from its declarations (``rpcs.RPCS``): each request's
body is validated into its declared model, and its blobs counted, before the handler runs; the
handler's reply must be the declared reply model. ``ask`` sends a request model and validates the
reply into its declared model: a peer's malformed reply is refused in one line, as a server
refuses a malformed request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from meshlearn.errors import BadMessage
from meshlearn.network.channel.envelope import Envelope
from meshlearn.network.channel.rpc import call
from meshlearn.network.protocol.message import Message
from meshlearn.network.protocol.rpcs import RELAY_CLOSE, RELAY_OPEN, RPCS, Rpc, Server, UndeclaredRpc, served_by

M = TypeVar("M", bound=Message)
# A typed handler: the request's model and its envelope (who sent it, from where, its blobs) -> the
# reply model, or the reply model and its blobs
Handler = Callable[[Any, Envelope], Any]


def serve(server: Server, handlers: Mapping[Rpc, Handler], declared: tuple[Rpc, ...] | None = None
          ) -> dict[str, Callable[[Envelope], Any]]:
    """``server``'s dispatch table (kind -> what ``RpcServer`` calls), one typed handler per request
    ``declared`` for it (by default in ``rpcs.RPCS``), each wrapped to validate what comes and goes."""
    rpcs = served_by(server) if declared is None else tuple(rpc for rpc in declared if rpc.server is server)
    given, wanted = {rpc.key for rpc in handlers}, {rpc.key for rpc in rpcs}
    if given != wanted:
        undeclared = sorted(name for _, name in given - wanted)
        unserved = sorted(name for _, name in wanted - given)
        raise UndeclaredRpc(f"the {server.value}'s handlers do not match its declarations in "
                            f"meshlearn.network.protocol.rpcs: undeclared {undeclared or 'none'}, "
                            f"without a handler {unserved or 'none'}")
    return {rpc.name: _typed(rpc, handlers[rpc]) for rpc in rpcs}


def _typed(rpc: Rpc, handler: Handler) -> Callable[[Envelope], Any]:
    """``handler`` behind ``rpc``'s checks: the request's body and blobs on the way in, the reply's on the way out."""

    def handle(request: Envelope) -> tuple[dict, list]:
        _count_blobs(rpc, rpc.blobs_in, len(request.blobs), "the request")
        message = rpc.request.read(request.body, rpc.name)
        answer = handler(message, request)
        reply, blobs = answer if isinstance(answer, tuple) else (answer, [])
        if not isinstance(reply, rpc.reply):  # a bug of this server, not the caller's fault
            raise TypeError(f"the handler of {rpc.name} answered {type(reply).__name__}, not {rpc.reply.__name__}")
        _count_blobs(rpc, rpc.blobs_out, len(blobs), "the reply")
        return reply.body(), list(blobs)

    return handle


def _count_blobs(rpc: Rpc, count: tuple[int, int], got: int, what: str) -> None:
    low, high = count
    if not low <= got <= high:
        wanted = str(low) if low == high else f"{low} to {high}"
        raise BadMessage(f"{rpc.name}: {what} carries {got} blob(s), not {wanted}")


def ask_with_blobs(address: str, rpc: Rpc, message: Message, secret: bytes, *, blobs: list | None = None,
                   **options: Any) -> tuple[Message, list]:
    """Send ``message`` as ``rpc`` to ``address`` and return the reply model and its blobs;
    ``options`` are ``channel.rpc.call``'s (timeout, sender, max_bytes, keys). Raises what ``call``
    raises, and BadMessage where the reply does not fit its declaration."""
    if not isinstance(message, rpc.request):
        raise TypeError(f"{rpc.name} takes {rpc.request.__name__}, not {type(message).__name__}")
    envelope = call(address, rpc.name, message.body(), secret, blobs=blobs, **options)
    _count_blobs(rpc, rpc.blobs_out, len(envelope.blobs), f"the reply from {address}")
    return rpc.reply.read(envelope.body, f"the reply to {rpc.name} from {address}"), envelope.blobs


RELAY_TIMEOUT = 10.0  # seconds the bootstrap may take to open or close a relay allocation


def relay_requests(ask_bootstrap: Callable[..., Message]) -> Callable[[str, dict], dict]:
    """What a relay agent (``channel.relayagent.hold_allocation``, below the protocol) asks the
    bootstrap with, ``(kind, body) -> the reply's body``, made of the participant's own
    ``ask_bootstrap(rpc, request model, timeout=...) -> reply model``: relay.open and relay.close
    only, each body validated into its declared model on the way out, the reply on the way back."""
    relay_rpcs = {rpc.name: rpc for rpc in (RELAY_OPEN, RELAY_CLOSE)}

    def relay_ask(kind: str, body: dict) -> dict:
        rpc = relay_rpcs[kind]
        return ask_bootstrap(rpc, rpc.request.read(body, kind), timeout=RELAY_TIMEOUT).body()

    return relay_ask


def ask(address: str, rpc: Rpc, message: Message, secret: bytes, **options: Any) -> Any:
    """Send ``message`` as ``rpc`` to ``address`` and return the reply model (see ``ask_with_blobs``)."""
    return ask_with_blobs(address, rpc, message, secret, **options)[0]


__all__ = ["RPCS", "UndeclaredRpc", "ask", "ask_with_blobs", "relay_requests", "serve"]
