"""Count the lines written twice: rules of an algorithm that exist once in the process engine's
runtime and again, in other words, in the batched engine's (issue 35's measure).

Each rule is a pair of lists of places (``file::Qualified.name``, or ``file::*`` for a whole
file), the process engine's and the batched engine's; a side's count is its code lines (not blank,
not comments, not docstrings). A pair counts both sides while both restate the rule; once one side
calls the other's single implementation, the rule drops out and what is still restated (glue that
applies it) is listed as its own pair. A place is listed while it restates a decision the other
engine's code makes too (which weight a node's own payload gets, what a sender not heard means,
when a rule replaces the weighted sum, what a bad node sends, the order of an iteration's steps or
of the calls into a state machine); an engine's own mechanics around the one implementation (the
process engine's messages, sockets and threads, the batched engine's link tensors and modelled
clocks) are not, nor is a side that only calls the one implementation (``definitions/``,
``aggregation/``, ``attacks/``, ``sharing/``, ``iterations.py``). The lists are written for a
commit's layout: ``--layout before`` for the tree before issue 35 (220d4f4), ``--layout features``
for the exchange features on the round runners (cc3a6dc, with the leader's members' side of
cbd2f49), ``--layout after`` for main after the cuts that followed.

    python3 benchmarks/written_twice.py --root /path/to/tree --layout before
    python3 benchmarks/written_twice.py --root /path/to/tree --layout features
    python3 benchmarks/written_twice.py --root . --layout after
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from pathlib import Path

A = "src/meshlearn/algorithms/"  # the process engine's runtimes before they moved under node/
N = "src/meshlearn/node/algorithms/"  # and after
B = "src/meshlearn/batched/"
BEFORE = {
    "D-PSGD's exchange (whole models, rounds, counting)": (
        [A + "dpsgd.py::DPSGD.__init__", A + "dpsgd.py::DPSGD.after_local_steps", A + "dpsgd.py::DPSGD._join_round",
         A + "dpsgd.py::DPSGD._send"],
        [B + "algorithms/dpsgd.py::BatchedDPSGD.__init__", B + "algorithms/dpsgd.py::BatchedDPSGD.after_local_steps",
         B + "algorithms/dpsgd.py::BatchedDPSGD._join_round", B + "algorithms/dpsgd.py::BatchedDPSGD._sources",
         B + "mixing.py::MetropolisMixing", B + "mixing.py::Links.of_round"]),
    "missing-value rules (lost chunks, partial shares)": (
        [A + "averaging.py::_element_mask", A + "averaging.py::per_chunk_weights",
         A + "averaging.py::fill_local_weights", A + "averaging.py::masked_average_"],
        [B + "mixing.py::ChunkedMixing", B + "mixing.py::_incoming_rows"]),
    "robust aggregation": (
        [A + "dpsgd.py::DPSGD._aggregate_robust", A + "dpsgd.py::_vector"],
        [B + "robust.py::RobustMixing.__init__", B + "robust.py::RobustMixing.mix_"]),
    "peer reports": (["src/meshlearn/aggregation/suspects.py::PeerWatch.report"],
                     [B + "robust.py::RobustMixing.reports"]),
    "sharing schemes' exchange": ([A + "dpsgd.py::DPSGD._exchange_shares"], [B + "sharing.py::SharedMixing"]),
    "what a bad node sends": ([A + "base.py::AlgorithmContext.outgoing"],
                              [B + "byzantine.py::BadNodes.forge", B + "byzantine.py::BadNodes.forge_row",
                               B + "byzantine.py::BadNodes.sent"]),
    "gossip": (
        [A + "gossip.py::GossipAverager.update_send", A + "gossip.py::GossipAverager.update_wait",
         A + "gossip.py::GossipAverager._publish", A + "gossip.py::GossipAverager._merge_robust"],
        [B + "algorithms/gossip.py::_Fetch", B + "algorithms/gossip.py::_Node",
         B + "algorithms/gossip.py::BatchedGossip"]),
    "leader (members' side; the leader's book is one, LeaderState)": (
        [A + "leader.py::Leader.after_local_steps", A + "leader.py::Leader._exchange", A + "leader.py::Leader._drawn",
         A + "leader.py::Leader.respond", A + "leader.py::Leader.release", A + "leader.py::Leader._answer"],
        [B + "algorithms/leader.py::BatchedLeader"]),
    "FedAvg's server and clients": (
        [A + "fedavg.py::FedAvg.after_local_steps", A + "fedavg.py::FedAvg._serve", A + "fedavg.py::FedAvg._take_part"],
        [B + "algorithms/fedavg.py::BatchedFedAvg"]),
}
AFTER = {
    "an iteration's exchanges: phases and the overlapped one (their order: definitions/exchange.run_exchanges, "
    "once; each engine's wait and start of the overlapped one are its own mechanics)": ([], []),
    "a merge: which rule replaces the weighted sum, the weight a sender not heard leaves with the node "
    "(definitions/exchange.merge_came, once; each engine's sums over its messages or links are its own)": ([], []),
    "the glue around the robust step (the step itself: definitions/dpsgd.robust_merge, once)": (
        [N + "rounds.py::_Came.robust"], [B + "robust.py::RobustMixing.mixed"]),
    "applying the missing-chunk rule (the rules: definitions/dpsgd.MISSING_CHUNK_RULES, once)": (
        ["src/meshlearn/definitions/averaging.py::masked_average_"],
        [B + "mixing.py::ChunkedMixing.weights", B + "mixing.py::ChunkedMixing.mixed"]),
    "sharing schemes' exchange (reading and merging what came: definitions/averaging.take_shares_, once)": ([], []),
    "what a bad node sends (its first payload of each width, the honest tail: definitions/exchange.BadSenders, "
    "once); whom a rushing one sees": ([N + "rounds.py::RoundRunner._rushing"],
                                      [B + "byzantine.py::BadNodes.silent", B + "byzantine.py::BadNodes.forge"]),
    "gossip: the order a node calls its GossipState in (its decisions, what it publishes too: "
    "definitions/gossipstate.py, once; each engine carries fetches and waits for them its own way)": (
        [N + "gossip.py::GossipAverager.update_send", N + "gossip.py::GossipAverager.update_wait",
         N + "gossip.py::GossipAverager._publish"],
        [B + "algorithms/gossip.py::_GossipRun.start", B + "algorithms/gossip.py::_GossipRun.publish",
         B + "algorithms/gossip.py::_GossipRun.merge"]),
    "leader: the order a member calls its LeaderMember and the leader its book in (their decisions: "
    "definitions/leadermember.py and leaderstate.py, once)": (
        [N + "leader.py::Leader.after_local_steps", N + "leader.py::Leader._take", N + "leader.py::Leader.release"],
        [B + "algorithms/leader.py::_LeaderRun.done", B + "algorithms/leader.py::_LeaderRun.push_arrives",
         B + "algorithms/leader.py::_LeaderRun.reply", B + "algorithms/leader.py::_LeaderRun.release"]),
    "each engine's part of an iteration: whom it asks to train, what it records (the order of its steps: "
    "iterations.drive; which evaluations an eval event holds and their fields: iterations.py, once)": (
        ["src/meshlearn/node/iterations.py::NodeIterations._idle", "src/meshlearn/node/iterations.py::NodeIterations.finish"],
        [B + "engine.py::_Lockstep._trainers", B + "engine.py::_Lockstep.finish"]),
    "restoring a run from its checkpoint (iterations.restore_run, once)": (
        ["src/meshlearn/node/node.py::Node._restore"], [B + "engine.py::BatchedSimulation._restore"]),
}
FEATURES = {  # the lists above, for the tree before the cuts that moved those rules into one place
    "an iteration's exchanges: phases and the overlapped one": (
        [N + "rounds.py::RoundRunner.after_local_steps", N + "rounds.py::RoundRunner._phases"],
        [B + "algorithms/rounds.py::BatchedRounds.after_local_steps"]),
    "a merge: which rule replaces the weighted sum, the weight a sender not heard leaves with the node": (
        [N + "rounds.py::RoundRunner._merge"], [B + "algorithms/rounds.py::BatchedRounds._merge", B + "mixing.py::heard_weights"]),
    "the glue around the robust step (the step itself: definitions/dpsgd.robust_merge, once)": (
        [N + "rounds.py::RoundRunner._merge_robust"], [B + "robust.py::RobustMixing.mixed"]),
    "applying the missing-chunk rule (the rules: definitions/dpsgd.MISSING_CHUNK_RULES, once)": (
        ["src/meshlearn/definitions/averaging.py::masked_average_"],
        [B + "mixing.py::ChunkedMixing.weights", B + "mixing.py::ChunkedMixing.mixed"]),
    "sharing schemes' exchange (the step: definitions/averaging.merge_shares_, once)": (
        [N + "rounds.py::RoundRunner._exchange_shares"], [B + "sharing.py::SharedMixing.mix_", B + "sharing.py::_read"]),
    "what a bad node sends (its first payload of each width, the honest tail); whom a rushing one sees": (
        [N + "base.py::AlgorithmContext.outgoing", N + "rounds.py::RoundRunner._forged", N + "rounds.py::RoundRunner._send"],
        [B + "byzantine.py::BadNodes.forge", B + "byzantine.py::BadNodes.forge_row", B + "byzantine.py::BadNodes.silent"]),
    "gossip: the order a node calls its GossipState in (its decisions: definitions/gossipstate.py, once)": (
        [N + "gossip.py::GossipAverager.update_send", N + "gossip.py::GossipAverager.update_wait",
         N + "gossip.py::GossipAverager._publish"],
        [B + "algorithms/gossip.py::_GossipRun.start", B + "algorithms/gossip.py::_GossipRun.done",
         B + "algorithms/gossip.py::_GossipRun.merge"]),
    **{rule: places for rule, places in AFTER.items() if rule.startswith("leader")},  # the same places there
    "each engine's part of an iteration (the order of its steps: iterations.drive, once)": (
        ["src/meshlearn/node/iterations.py::NodeIterations.train", "src/meshlearn/node/iterations.py::NodeIterations.finish",
         "src/meshlearn/node/iterations.py::NodeIterations._evaluation_event", "src/meshlearn/node/node.py::Node.validate",
         "src/meshlearn/node/node.py::Node.evaluate_shard"],
        [B + "engine.py::_Lockstep.train", B + "engine.py::_Lockstep.finish", B + "engine.py::_Run.write_evaluation"]),
    "restoring a run from its checkpoint": (
        ["src/meshlearn/node/node.py::Node._restore"], [B + "engine.py::BatchedSimulation._restore"]),
}
LAYOUTS = {"before": BEFORE, "features": FEATURES, "after": AFTER}


def code_lines(path: Path, qualname: str) -> int:
    """Code lines of ``qualname`` (``*``: the whole file) in ``path``; 0 if it is not there."""
    source = path.read_text()
    tree = ast.parse(source)
    span = (1, len(source.splitlines())) if qualname == "*" else _span(tree, qualname.split("."))
    if span is None:
        return 0
    skip = _docstring_lines(tree)
    comment_only = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                    if tok.type == tokenize.COMMENT and not source.splitlines()[tok.start[0] - 1].split("#")[0].strip()}
    lines = source.splitlines()
    return sum(1 for n in range(span[0], span[1] + 1)
               if lines[n - 1].strip() and n not in skip and n not in comment_only)


def _span(tree: ast.AST, names: list[str]) -> tuple[int, int] | None:
    body = tree.body
    node = None
    for name in names:
        node = next((n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == name), None)
        if node is None:
            return None
        body = node.body
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return first, node.end_lineno


def _docstring_lines(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if docstring and isinstance(first.value.value, str):
                found.update(range(first.lineno, first.end_lineno + 1))
    return found


def count(root: Path, layout: dict) -> tuple[int, list[tuple[str, int, int]]]:
    """(total, per rule: (rule, process side, batched side)) of the twins listed in ``layout``."""
    rows = []
    for rule, sides in layout.items():
        counts = [sum(code_lines(root / place.split("::")[0], place.split("::")[1]) for place in side)
                  for side in sides]
        rows.append((rule, *counts))
    return sum(a + b for _, a, b in rows), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", type=Path)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="after")
    args = parser.parse_args()
    total, rows = count(args.root, LAYOUTS[args.layout])
    for rule, process, batched in rows:
        print(f"{process:5d} {batched:5d}  {rule}")
    source = sum(code_lines(path, "*") for path in (args.root / "src/meshlearn").rglob("*.py"))
    print(f"{total} lines written twice, of {source} code lines ({100 * total / source:.1f}%)")


if __name__ == "__main__":
    main()
