"""Host several nodes in one process, one thread each: for tests, notebooks and small studies."""

from __future__ import annotations

import threading
from typing import Callable, Sequence

from meshlearn.errors import MeshlearnError
from meshlearn.node import Node


def run_threads(nodes: Sequence[Node], timeout: float | None = None,
                on_bound: Callable[[dict[int, str]], None] | None = None) -> dict[int, dict]:
    """Bind every node's endpoint, give each its neighbours' addresses, and run them all.

    ``on_bound`` is called with the address book once every endpoint is bound, before any node
    connects. Returns each node's final summary by rank; re-raises the first node's exception.
    """
    book = {node.rank: node.transport.bind() for node in nodes}
    if on_bound is not None:
        on_bound(book)
    results: dict[int, dict] = {}
    errors: dict[int, BaseException] = {}

    def target(node: Node) -> None:
        try:
            results[node.rank] = node.run(node.contacts(book))
        except BaseException as exc:  # surfaced to the caller below
            errors[node.rank] = exc

    threads = [threading.Thread(target=target, args=(n,), name=f"node-{n.rank}", daemon=True) for n in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    if errors:
        rank = min(errors)
        raise errors[rank]
    if len(results) != len(nodes):
        raise MeshlearnError(f"{len(nodes) - len(results)} node(s) did not finish within {timeout} s")
    return results
