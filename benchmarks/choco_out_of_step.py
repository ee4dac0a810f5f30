"""How much of a CHOCO-SGD neighbour's estimate a receiver leaves out of its consensus step when
whole updates are lost, with and without the window of absolute values each message carries.

    python benchmarks/choco_out_of_step.py                  # 10,000 values, 300 updates, a tenth lost
    python benchmarks/choco_out_of_step.py --still 0.5 --clean 100   # half never change; 100 more, none lost

One sender and one receiver, every value drifting at random (a ``--still`` share never moves), a
``--loss`` share of the updates lost whole (then ``--clean`` more, none lost). Per ALPHA and
receiver, the mean over seeds of: the share out of step (left out) over every update and over the
updates that arrived; the share whose estimate truly differs from the sender's (the least any
receiver could leave out); and the share out of step after the last update. Receivers: ``no
window`` ignores the window (the code before it was sent, bit for bit), ``window`` is the scheme
as it is, ``told`` a model of one also told where up to ``TOLD_BACK`` updates lost in a row wrote
(what bitmaps of their positions in each message would cost P/8 bytes apiece to say).
"""

from __future__ import annotations

import argparse

import torch

from meshlearn.sharing import Shared, make_sharing

RECEIVERS = ("no window", "window", "told")
TOLD_BACK = 2  # lost updates in a row whose positions the ``told`` receiver learns


def run(alpha: float, seed: int, receiver: str, numel: int, updates: int, loss: float, still: float,
        clean: int = 0) -> dict[str, float]:
    """One sender's ``updates`` (then ``clean`` ones, none lost) to one ``receiver`` (``RECEIVERS``);
    the out-of-step shares (see the module docstring). Checks that what is in step is the sender's."""
    generator = torch.Generator().manual_seed(seed)
    sender, node = (make_sharing(f"choco:{alpha}", numel, torch.float32, seed=1) for _ in range(2))
    model, moving = torch.zeros(numel), torch.rand(numel, generator=generator) >= still
    every, arrived, differs = [], [], []
    written: list[torch.Tensor] = []  # where each update lost in a row wrote
    before = torch.zeros(numel, dtype=torch.bool)  # out of step before those losses
    for iteration in range(updates + clean):
        model += torch.randn(numel, generator=generator) * moving
        tensors = sender.encode(model, 1, iteration)
        lost = bool(torch.rand(1, generator=generator) < loss) and iteration < updates
        share = node.decode(tensors, 1, iteration)
        if lost and not written:
            before = node.stale.get(1, torch.zeros(numel, dtype=torch.bool)).clone()
        if lost:
            written.append(share.mask)
        if receiver == "no window":
            share = Shared(share.values, share.mask, share.unsure)
        node.mix_(torch.zeros(numel), {1: 0.5}, {} if lost else {1: share})
        if not lost and written:
            if receiver == "told" and len(written) <= TOLD_BACK:
                _told(node, before, written, share)
            written = []
        stale = node.stale.get(1, torch.zeros(numel, dtype=torch.bool))
        assert torch.equal(node.estimates[1][~stale], sender.own[~stale])
        every.append(float(stale.float().mean()))
        if not lost:
            arrived.append(every[-1])
            differs.append(float((node.estimates[1] != sender.own).float().mean()))
    return {"every": sum(every) / len(every), "arrived": sum(arrived) / len(arrived),
            "differs": sum(differs) / len(differs), "last": every[-1]}


def _told(node, before: torch.Tensor, written: list[torch.Tensor], share) -> None:
    """The ``told`` receiver: out of step only where it was before the losses and where the lost
    updates wrote, less what this update (and its window) sent again."""
    stale = before | torch.stack(written).any(0)
    stale[share.mask] = False
    stale[share.window] = False
    node.stale[1] = stale


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.05, 0.2])
    parser.add_argument("--numel", type=int, default=10_000)
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--loss", type=float, default=0.1, help="share of the updates lost whole")
    parser.add_argument("--still", type=float, default=0.0, help="share of the values that never change")
    parser.add_argument("--clean", type=int, default=0, help="updates after those, none lost")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("| ALPHA | receiver | out of step, every update | at updates that arrived | truly differs | after the last |")
    print("|---|---|---|---|---|---|")
    for alpha in args.alphas:
        for receiver in RECEIVERS:
            runs = [run(alpha, seed, receiver, args.numel, args.updates, args.loss, args.still, args.clean)
                    for seed in range(args.seeds)]
            mean = {key: sum(r[key] for r in runs) / len(runs) for key in runs[0]}
            print(f"| {alpha:g} | {receiver} | {mean['every']:.1%} | {mean['arrived']:.1%} | "
                  f"{mean['differs']:.1%} | {mean['last']:.1%} |")


if __name__ == "__main__":
    main()
