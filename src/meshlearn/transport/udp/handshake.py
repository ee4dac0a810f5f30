"""UDP's HELLO handshake, as state: no socket, no clock.

Every node sends HELLO to each neighbour until that neighbour has said it heard it. A HELLO
carries FLAG_HEARD once its sender has heard the receiver, and is answered (with FLAG_HEARD and
FLAG_REPLY, never answered itself) while its sender still sends them. A neighbour is done when a
HELLO from it says it heard this node; datagrams may be lost, so each side keeps asking.
"""

from __future__ import annotations

from typing import Iterable

from meshlearn.wire.datagram import FLAG_HEARD, FLAG_REPLY


class Handshake:
    """Who has been heard from, and who has heard this node."""

    def __init__(self) -> None:
        self.heard: set[int] = set()  # neighbours whose HELLO came
        self.acked: set[int] = set()  # neighbours that said they heard this node

    def on_hello(self, sender: int, flags: int) -> int | None:
        """Take a HELLO; the flags of the HELLO to answer it with, or None when it needs none."""
        self.heard.add(sender)
        if flags & FLAG_HEARD:
            self.acked.add(sender)
        return None if flags & FLAG_REPLY else FLAG_HEARD | FLAG_REPLY

    def waiting(self, peers: Iterable[int], departed: set[int]) -> set[int]:
        """The neighbours that have not yet said they heard this node (and did not leave)."""
        return set(peers) - self.acked - departed

    def hello_flags(self, peer: int) -> int:
        """The flags of the next HELLO to ``peer``."""
        return FLAG_HEARD if peer in self.heard else 0
