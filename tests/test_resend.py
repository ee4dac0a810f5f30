"""A sealed model damaged on the way over TCP is refused by its receiver at once and sent again
by its sender (``transport.tcp``): real transports on loopback, with ``helpers.tamper`` proxies on
the path that damage what passes, or play refusals again, or forge them."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import torch
from helpers.pairs import close_together
from helpers.tamper import FROM_NODE, TO_NODE, TamperProxy
from helpers.waiting import wait_until

from meshlearn.transport.settings import TcpSettings
from meshlearn.transport.tcp import MAX_RESENDS, TcpTransport
from meshlearn.wire import Kind, Message
from meshlearn.wire.sealed import FrameSeal

KEY = bytes(range(32))
LONG = 600.0  # seconds a gather would wait for a model it is not told is damaged: far past the test's limit
SHORT = 2.0  # seconds a closing transport waits for its peer's goodbye
MODEL = {"w": torch.arange(4096, dtype=torch.float32)}  # 16 KiB: a model to the proxies (4096 bytes and more)

pytestmark = pytest.mark.timeout(60)


class _Listening:
    """Keeps a transport reading (as a node does in its next gather), on a thread of its own,
    which is then the only one that uses it."""

    def __init__(self, transport: TcpTransport):
        self.transport = transport
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            self.transport.recv(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


def _through(stack: ExitStack, *proxies: tuple[str, dict]) -> tuple[TcpTransport, TcpTransport]:
    """Sealed transports ``a`` (0) and ``b`` (1), handshaken, ``a`` reaching ``b`` through the
    ``proxies`` (kind, settings), the first in front of ``b``."""
    settings = TcpSettings(handshake_timeout=20, wait_timeout=SHORT, linger=0)
    a, b = (TcpTransport(rank, settings=settings, seal=FrameSeal(KEY)) for rank in (0, 1))
    stack.callback(close_together, a, b)
    address_a, address = a.bind(), b.bind()
    for kind, tampering in proxies:
        address = stack.enter_context(TamperProxy(address, kind, **tampering)).address
    thread = threading.Thread(target=b.connect, args=({0: address_a},))
    thread.start()
    a.connect({1: address})
    thread.join()
    return a, b


def _send_model(a: TcpTransport) -> _Listening:
    a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, MODEL))
    return _Listening(a)


def test_a_damaged_model_is_refused_and_sent_again_at_once():
    with ExitStack() as stack:
        a, b = _through(stack, ("flip", {"every": 1, "limit": 1, "directions": (TO_NODE,)}))
        listening = _send_model(a)
        got = b.gather(0, [0], timeout=LONG)  # no deadline reached: the copy sent again came
        listening.stop()
        assert torch.equal(got[0].tensors["w"], MODEL["w"])
        assert b.stats.malformed_dropped == 1 and b.refusals_sent == 1 and b.stats.gather_timeouts == 0
        assert a.resent == 1 and a.resends_declined == 0


def test_a_path_that_damages_every_copy_has_it_sent_again_a_bounded_number_of_times():
    with ExitStack() as stack:
        a, b = _through(stack, ("flip", {"every": 1, "limit": 10**6, "directions": (TO_NODE,)}))
        listening, refusing = _send_model(a), _Listening(b)
        assert wait_until(lambda: a.resends_declined == 1, timeout=30)
        listening.stop()
        refusing.stop()
        assert a.resent == MAX_RESENDS and b.refusals_sent == MAX_RESENDS + 1
        assert b.gather(0, [0], timeout=0.5) == {} and b.stats.gather_timeouts == 1  # it costs the wait, as before


def test_a_model_refused_after_its_sender_said_goodbye_is_still_sent_again():
    """Its sender's last model, damaged, and its goodbye right after: the receiver still waits for
    the copy it asked for (the sender, closing, answers refusals while it waits for goodbyes)."""
    with ExitStack() as stack:
        a, b = _through(stack, ("flip", {"every": 1, "limit": 1, "directions": (TO_NODE,)}))
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, MODEL))
        closing = threading.Thread(target=a.close)
        closing.start()
        got = b.gather(0, [0], timeout=LONG)
        b.close()
        closing.join()
        assert torch.equal(got[0].tensors["w"], MODEL["w"]) and 0 in b.departed
        assert a.resent == 1 and b.stats.gather_timeouts == 0


def test_a_sender_that_said_goodbye_and_will_not_send_again_says_so_and_is_not_waited_for():
    with ExitStack() as stack:
        a, b = _through(stack, ("flip", {"every": 1, "limit": 10**6, "directions": (TO_NODE,)}))
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, MODEL))
        closing = threading.Thread(target=a.close)
        closing.start()
        assert b.gather(0, [0], timeout=LONG) == {} and b.stats.gather_timeouts == 0
        b.close()
        closing.join()
        assert a.resent == MAX_RESENDS and a.resends_declined == 1


def test_a_refusal_played_again_sends_nothing_again():
    with ExitStack() as stack:  # the model damaged twice; the first refusal played again beside the second
        a, b = _through(stack, ("flip", {"every": 1, "limit": 2, "directions": (TO_NODE,)}),
                        ("replay", {"every": 1, "copies": 1, "min_bytes": 0, "directions": (FROM_NODE,)}))
        listening = _send_model(a)
        got = b.gather(0, [0], timeout=LONG)
        assert wait_until(lambda: a.stats.replay_dropped == 1)
        listening.stop()
        assert torch.equal(got[0].tensors["w"], MODEL["w"])
        assert b.refusals_sent == 2 and a.resent == 2 and a.resends_declined == 0


def test_a_forged_refusal_sends_nothing_again():
    with ExitStack() as stack:  # the model damaged once; its refusal replaced by bytes sealed with no key
        a, b = _through(stack, ("flip", {"every": 1, "limit": 1, "directions": (TO_NODE,)}),
                        ("garbage", {"every": 1, "limit": 1, "min_bytes": 0, "directions": (FROM_NODE,)}))
        listening, refusing = _send_model(a), _Listening(b)
        assert wait_until(lambda: a.stats.malformed_dropped == 1)
        listening.stop()
        refusing.stop()
        assert b.refusals_sent == 1 and a.resent == 0
        assert b.gather(0, [0], timeout=0.5) == {}


def test_a_replayed_model_is_dropped_without_a_refusal():
    with ExitStack() as stack:  # the first model recorded, played again after the second
        a, b = _through(stack, ("replay", {"every": 1, "copies": 1, "directions": (TO_NODE,)}))
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, MODEL))
        a.broadcast([1], Message(Kind.MODEL, 0, 1, 1, MODEL))
        listening = _Listening(a)
        assert set(b.gather(0, [0], timeout=LONG)) == {0} and set(b.gather(1, [0], timeout=LONG)) == {0}
        assert wait_until(lambda: b.recv(0.05) is None and b.stats.replay_dropped == 1)  # the copy, once read
        listening.stop()
        assert b.stats.replay_dropped == 1 and b.refusals_sent == 0 and a.resent == 0
