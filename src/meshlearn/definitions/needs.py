"""What an algorithm declares it needs, and which runs it refuses because of it.

Loads neither torch nor any algorithm: a configuration is checked against these declarations
before anything heavy starts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["transport", "pull", "hub", "none"]
ALL_SCHEMES = ("*",)


@dataclass(frozen=True)
class Needs:
    """An algorithm's declaration.

    ``endpoint``: what the process engine connects it with (``transport``: TCP or UDP as the run
    says, messages pushed to peers; ``pull``: request and answer, a node fetching a peer's model;
    ``hub``: members pushing to a server that answers; ``none``: nothing). ``synchronous``: in
    lockstep iterations (the batched engine runs the others in modelled time). The rest says
    what it can run with: a lossy transport (UDP), sharing schemes (names, or ``*`` for any),
    robust aggregation rules, bad nodes, peers that change every round (``peer_sampling``, the
    one-peer exponential graph), the batched engine split over torchrun processes, network
    tasks (``meshlearn request``), and an outer optimizer after each iteration (``outer``: a
    node's model after the iteration's steps and exchanges is the round's aggregate)."""

    endpoint: Endpoint = "transport"
    synchronous: bool = True
    lossy: bool = False
    sharing: tuple[str, ...] = ("full",)
    robust: bool = False
    byzantine: bool = False
    dynamic: bool = False
    torchrun: bool = False
    network: bool = False
    outer: bool = False
    why_not: tuple[tuple[str, str], ...] = ()  # (feature, why it does not take it): said with a refusal

    def reason(self, feature: str) -> str:
        """Why it does not take ``feature`` (``lossy``, ``sharing``, ``robust``, ``byzantine``,
        ``dynamic``, ``outer``), as its declaration says: `` (why)``, or "" where it says nothing."""
        why = dict(self.why_not).get(feature)
        return f" ({why})" if why else ""


@dataclass(frozen=True)
class RunShape:
    """What of a run an algorithm's declaration is checked against (plain values, no config)."""

    engine: str
    transport: str
    sharing: str
    aggregation: str
    byzantine: bool
    dynamic: str  # "" for a static graph; else what makes the peers change (for the message)
    full_epochs: bool = False
    plain_sgd: bool = True
    emulated: str = ""  # the user-space network emulation asked for (delay, jitter, rate), "" for none
    outer: str = ""  # the outer optimizer asked for, "" for none


def refusal(name: str, needs: Needs, run: RunShape) -> str | None:
    """Why ``run`` cannot run algorithm ``name`` (one line: what it needs, and what to change), or None."""
    if run.transport != "tcp" and not needs.lossy:
        if needs.endpoint in ("pull", "hub"):
            return f"{name} exchanges models by request and answer over TCP: use transport tcp"
        return f"algorithm {name} needs transport tcp" + (needs.reason("lossy") or " (every message whole)")
    lacking = [
        (not accepts_sharing(needs, run.sharing), "sharing full" + needs.reason("sharing")),
        (run.aggregation != "mean" and not needs.robust, "aggregation mean" + needs.reason("robust")),
        (run.byzantine and not needs.byzantine, "no byzantine nodes" + needs.reason("byzantine")),
        (bool(run.dynamic) and not needs.dynamic, f"a static topology (not {run.dynamic})" + needs.reason("dynamic")),
        (run.engine == "batched" and not needs.synchronous and run.full_epochs,
         "rounds counted in mini-batches on the batched engine (not full_epochs): or use the process engine"),
        (run.engine == "batched" and not needs.synchronous and not run.plain_sgd,
         "optimizer sgd on the batched engine, which steps its nodes one by one: or use the process engine"),
        (run.engine == "process" and bool(run.emulated) and needs.endpoint in ("pull", "hub"),
         f"no emulated {run.emulated} on the process engine, whose request-and-answer channels are not emulated: "
         "drop them from --net, or use the batched engine, which models them"),
        (bool(run.outer) and not needs.outer, f"outer none (not {run.outer}): its exchanges are not rounds with an "
         "aggregate an outer step could follow; use dpsgd, gossip, fedavg or leader")]
    for lacks, what in lacking:
        if lacks:
            return f"algorithm {name} needs {what}"
    return None


def accepts_sharing(needs: Needs, sharing: str) -> bool:
    """Whether an algorithm of ``needs`` runs with sharing scheme ``sharing`` (``NAME[:ARG...]``)."""
    scheme = sharing.partition(":")[0]
    return scheme == "full" or needs.sharing == ALL_SCHEMES or scheme in needs.sharing
