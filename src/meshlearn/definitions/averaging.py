"""Averaging kernels on whole flat buffers, and D-PSGD's missing-value rules (``definitions.dpsgd``)
applied to one node's models where only some chunks or values arrived: the process engine's
averages for its node, and the step with a sharing scheme both engines take (``take_shares_``).
Torch at import: no module the configuration imports loads this one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, NamedTuple

import torch

from meshlearn.definitions.dpsgd import MissingValueRule

if TYPE_CHECKING:
    from meshlearn.sharing import Shared, Sharing


def weighted_average_(target: torch.Tensor, own_weight: float, others: list[tuple[float, torch.Tensor]]) -> None:
    """In place: ``target = own_weight * target + sum(w * t for w, t in others)``.

    One pass over memory per term; received tensors may live on another device (the CPU)
    and are moved once.
    """
    with torch.no_grad():
        target.mul_(own_weight)
        for weight, tensor in others:
            target.add_(tensor.to(target.device, non_blocking=True), alpha=weight)


def masked_average_(state: torch.Tensor, own_weight: float,
                    received: list[tuple[float, int, torch.Tensor, torch.Tensor]], rule: MissingValueRule,
                    unit_elements: int = 1) -> None:
    """In place: Metropolis-Hastings averaging of models of which only some values arrived.

    ``received`` holds, per neighbour, its Metropolis-Hastings weight, its degree, its values over
    the whole state and a mask of the units that arrived (each unit ``unit_elements`` values: a
    chunk, or one value); ``own_weight`` is the node's own (the weights of all neighbours and the
    node sum to one). ``rule`` (of ``MISSING_CHUNK_RULES``, D-PSGD's rules over stacks, run here
    for one node) gives each neighbour's weight per unit; the node keeps the rest.
    """
    if not received:
        return
    with torch.no_grad():
        present = torch.stack([mask.to(state.device, torch.float64) for *_, mask in received]).unsqueeze(0)
        weights = torch.tensor([[w for w, *_ in received]], dtype=torch.float64, device=state.device)
        degrees = torch.tensor([[d for _, d, *_ in received]], dtype=torch.float64, device=state.device)
        own = torch.tensor([own_weight], dtype=torch.float64, device=state.device)
        per_unit = rule(weights, present, own, degrees)[0]  # [K, units]
        if unit_elements > 1:
            per_unit = per_unit.repeat_interleave(unit_elements, dim=1)[:, :state.numel()]
        per_unit = per_unit.to(state.dtype)
        state.mul_(1.0 - per_unit.sum(0))
        for weight, (_, _, values, _) in zip(per_unit, received):
            state.addcmul_(weight, values.to(state.device))


def average_shares_(state: torch.Tensor, shares: list[tuple[float, int, torch.Tensor, torch.Tensor | None]],
                    rule: MissingValueRule) -> None:
    """In place: ``state`` <- its average with the neighbours' shares (weight, degree, values,
    mask of the values sent, or None for all of them), each value over those who sent it by
    ``rule``; the node keeps the weight of the neighbours that sent nothing."""
    own = 1.0 - sum(w for w, _, _, _ in shares)
    if all(mask is None for _, _, _, mask in shares):
        weighted_average_(state, own, [(w, values) for w, _, values, _ in shares])
        return
    everything = torch.ones(state.numel(), dtype=torch.bool)
    masked_average_(state, own, [(w, degree, values, everything if mask is None else mask)
                                 for w, degree, values, mask in shares], rule)


def merge_shares_(scheme: Sharing, state: torch.Tensor, weights: dict[int, float], shared: dict[int, Shared],
                  degrees: dict[int, int] | list[int], rule: MissingValueRule) -> list[int]:
    """In place: one node's D-PSGD step with a sharing scheme, in both engines: the scheme's own
    update where it makes one (CHOCO-SGD, over every neighbour's ``weights``), else the average of
    ``state`` with the neighbours' ``shared`` values (``average_shares_``, senders' ``degrees``);
    then the scheme's bookkeeping. Returns the senders whose updates the scheme lost track of."""
    lost: list[int] = []
    if scheme.mixes:
        lost = scheme.mix_(state, weights, shared)
    else:
        average_shares_(state, [(weights[j], degrees[j], s.values, s.mask) for j, s in shared.items()], rule)
    scheme.averaged(state)
    return lost


class Taken(NamedTuple):
    """What ``take_shares_`` took of the messages that arrived."""

    read: list[int]  # the senders whose messages the scheme read (not refused)
    shared: dict[int, Shared]  # what it could place of each
    lost: list[int]  # the senders whose updates it lost track of


def take_shares_(scheme: Sharing, state: torch.Tensor, weights: dict[int, float],
                 arrived: Iterable[tuple[int, Callable[[], Shared | None]]], degrees: dict[int, int] | list[int],
                 rule: MissingValueRule, refused: Callable[[int, str], None] | None = None) -> Taken:
    """In place: one node's D-PSGD step with a sharing scheme over the messages that ``arrived``
    (both engines): each sender's ``receive()`` (the scheme's read of what came of its message, in
    part where chunks were lost), one the scheme refuses (ValueError: a diverged model's NaN) left
    out and told to ``refused``, one it can place nothing of (None) not heard; then ``merge_shares_``."""
    read: list[int] = []
    shared: dict[int, Shared] = {}
    for sender, receive in arrived:
        try:
            share = receive()
        except ValueError as exc:
            if refused is not None:
                refused(sender, str(exc))
            continue
        read.append(sender)
        if share is not None:
            shared[sender] = share
    return Taken(read, shared, merge_shares_(scheme, state, weights, shared, degrees, rule))
