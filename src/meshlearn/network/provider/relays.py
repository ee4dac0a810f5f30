"""The bootstrap relay's allocations a provider behind NAT holds: its server's (its front, the
address peers reach it at) and one per task engine, each served by an agent."""

from __future__ import annotations

from collections.abc import Callable

from meshlearn.network.channel.allocations import Holder
from meshlearn.network.channel.relayagent import Allocation, hold_allocation


class RelayAllocations:
    """The allocations this provider holds, each given back by its ``close``; ``ask(kind, body)``
    calls the bootstrap (proving the provider's key) and returns the reply's body (``protocol.serving.relay_requests``)."""

    def __init__(self, host: str, ask: Callable[[str, dict], dict]):
        self.host = host  # where this machine's served ports listen
        self.ask = ask
        self.front: Allocation | None = None  # its server's allocation, if it has one
        self.held: list[Allocation] = []  # every one it holds: the server's and tasks' engines

    @property
    def front_lost(self) -> bool:
        """Whether the relay forgot the front (it restarted): the provider registers again."""
        return self.front is not None and self.front.agent.lost.is_set()

    def allocate(self, port: int, holder: Holder, on_lost: Callable[[], None] | None = None) -> Allocation:
        """A relay allocation for this machine's ``port`` serving ``holder``, served by an agent
        (given back by close; ``on_lost`` told if the relay forgets it or dies)."""
        allocation = hold_allocation(self.ask, self.host, port, holder, on_lost)
        self.held.append(allocation)
        close = allocation.close

        def release() -> None:
            close()
            if allocation in self.held:
                self.held.remove(allocation)
        allocation.close = release
        return allocation

    def replace_front(self, port: int, holder: Holder, on_lost: Callable[[], None] | None = None) -> Allocation:
        """A new front for the server's ``port`` (the last one, if any, given back first; ``on_lost``
        told when it is lost)."""
        self.drop_front()
        self.front = self.allocate(port, holder, on_lost)
        return self.front

    def drop_front(self) -> None:
        """Give the front back, if it has one."""
        if self.front is not None:
            self.front.close()
            self.front = None

    def stop(self) -> None:
        """Stop every allocation's agent (the provider stops)."""
        for allocation in list(self.held):
            allocation.agent.stop()
