"""Two transports of one process, bound on loopback and handshaken with each other."""

from __future__ import annotations

import threading


def connected(a, b):
    """Bind ``a`` (node 0) and ``b`` (node 1) and run their handshakes (``b``'s in a thread, as
    each side waits for the other); returns them."""
    address_a, address_b = a.bind(), b.bind()
    thread = threading.Thread(target=b.connect, args=({0: address_a},))
    thread.start()
    a.connect({1: address_b})
    thread.join()
    return a, b


def close_together(*transports) -> None:
    """Close the transports at once (each waits for the others' goodbye, bounded by its linger)."""
    threads = [threading.Thread(target=transport.close) for transport in transports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
