"""CHOCO-SGD's rotating window: each message carries a share of the sender's estimate as it is, at
positions its iteration sets, which puts them back in step at every receiver."""

from __future__ import annotations

import math

import pytest
import torch

from meshlearn.sharing import make_sharing
from meshlearn.sharing.choco import WINDOW_SHARE, ChocoShared, window_positions


def _t(values, dtype=torch.float32):
    return torch.tensor(list(values), dtype=dtype)


def _spike(numel: int, **at: float) -> torch.Tensor:
    """A vector of zeros with the values given at positions ``p<position>``."""
    vector = torch.zeros(numel)
    for name, value in at.items():
        vector[int(name[1:])] = value
    return vector


def test_the_window_rotates_around_the_model_one_block_per_iteration():
    assert window_positions(10, 3, 0).tolist() == [0, 1, 2]
    assert window_positions(10, 3, 2).tolist() == [6, 7, 8]
    assert window_positions(10, 3, 3).tolist() == [9, 0, 1]  # around the end
    assert window_positions(10, 3, 1_000_001).tolist() == [3, 4, 5]  # (3 * 1,000,001) mod 10
    covered = torch.cat([window_positions(10, 3, k) for k in range(4)])  # ceil(10 / 3) messages
    assert set(covered.tolist()) == set(range(10))


def test_a_value_top_k_never_picks_again_comes_back_in_step_through_the_window():
    # 200 values: top-2 (choco:0.01) and a window of 2 (1%), gamma 1; the neighbour's weight 0.5
    sender, node = (make_sharing("choco:0.01:1", 200, torch.float32, seed=1) for _ in range(2))
    assert sender.window_size == 2 and sender.wire_bytes() == 2 * 4 + 2 * 4 + 2 * 4  # values, indices, window
    sender.encode(_spike(200, p3=2, p4=1, p198=5), 1, 0)  # positions 3 and 198 change; the node misses it
    state = torch.zeros(200)
    assert node.mix_(state, {1: 0.5}, {}) == [1]  # every position out of step
    tensors = sender.encode(_spike(200, p3=2, p4=1, p10=9, p11=8, p198=5), 1, 1)  # 10 and 11 change
    assert tensors["window"].tolist() == [0, 2]  # the estimate at 2 and 3, the window of iteration 1
    node.mix_(state, {1: 0.5}, {1: node.decode(tensors, 1, 1)})
    # in step: 10 and 11 (sent), 2 and 3 (the window); the node's own estimate is 0, so x += 1 * 0.5 * xhat
    assert torch.equal(state, _spike(200, p3=1, p10=4.5, p11=4))
    tensors = sender.encode(_spike(200, p3=2, p4=1, p10=9, p11=8, p20=0.5, p198=5), 1, 99)  # 4 and 20 change
    assert tensors["window"].tolist() == [5, 0]  # the estimate at 198 and 199: 198 is sent again
    state = torch.zeros(200)
    node.mix_(state, {1: 0.5}, {1: node.decode(tensors, 1, 99)})
    assert torch.equal(state, _spike(200, p3=1, p4=0.5, p10=4.5, p11=4, p20=0.25, p198=2.5))
    back = {2, 3, 4, 10, 11, 20, 198, 199}
    assert torch.nonzero(~node.stale[1]).flatten().tolist() == sorted(back)
    assert torch.equal(node.estimates[1][sorted(back)], sender.own[sorted(back)])


def test_over_udp_the_window_follows_the_pairs_and_only_its_values_that_arrived_are_placed():
    # 400 values: 4 pairs of 8 bytes, then a window of 4 float32 values: 6 chunks of 8 bytes
    sender, node = (make_sharing("choco:0.01:1", 400, torch.float32, seed=1, lossy=True) for _ in range(2))
    layout = sender.layout()
    assert [(s.name, s.offset, s.numel) for s in layout.segments] == [("pairs", 0, 32), ("window", 32, 16)]
    vector = torch.arange(400.0) / 100
    sender.encode(vector, 1, 0)  # 396 .. 399 change; the node misses it
    node.mix_(torch.zeros(400), {1: 0.5}, {})
    tensors = sender.encode(vector, 1, 9)  # 392 .. 395 change; the window of iteration 9 is 36 .. 39
    present = _t([1, 1, 1, 1, 0, 1]).bool()  # the chunk holding the window's first two values is lost
    share = node.receive(layout.received(tensors, present, 8), 1, 9, (present, 8))
    assert isinstance(share, ChocoShared)
    assert share.window.tolist() == [38, 39] and share.window_values.tolist() == [0.0, 0.0]  # still 0 there
    node.mix_(torch.zeros(400), {1: 0.5}, {1: share})
    assert torch.nonzero(~node.stale[1]).flatten().tolist() == [38, 39, 392, 393, 394, 395]


@pytest.mark.parametrize("lossy,window,problem", [
    (False, _t([1, 2, 3]), r"'window' is torch.float32 \[3\], expected torch.float32 \[2\]"),
    (False, _t([1, 2], torch.float64), r"'window' is torch.float64"),
    (False, _t([1, float("nan")]), "the window's values hold NaN"),
    (False, None, "no 'window' tensor"),
    (True, torch.zeros(7, dtype=torch.uint8), r"'window' is torch.uint8 \[7\], expected torch.uint8 \[8\]"),
    (True, _t([float("inf"), 0]).view(torch.uint8), "the window's values hold NaN or Inf"),
])
def test_a_malformed_window_is_refused_with_what_is_wrong(lossy, window, problem):
    sender, node = (make_sharing("choco:0.01", 200, torch.float32, seed=1, lossy=lossy) for _ in range(2))
    tensors = sender.encode(torch.randn(200, generator=torch.Generator().manual_seed(1)), 1, 0)
    tensors.pop("window")
    if window is not None:
        tensors["window"] = window
    with pytest.raises(ValueError, match=problem):
        node.decode(tensors, 1, 0)


def _out_of_step(alpha: float, updates: int, lossy_updates: int, still: float, seed: int = 0) -> list[float]:
    """The share of a neighbour's estimate out of step after each of ``updates`` of 10,000 values
    (a ``still`` share never changes, the rest drift at random), a tenth of the first
    ``lossy_updates`` lost whole; checks that every value in step equals the sender's, bit for bit."""
    numel, generator = 10_000, torch.Generator().manual_seed(seed)
    sender, node = (make_sharing(f"choco:{alpha}", numel, torch.float32, seed=1) for _ in range(2))
    model, moving = torch.zeros(numel), torch.rand(numel, generator=generator) >= still
    shares = []
    for iteration in range(updates):
        model += torch.randn(numel, generator=generator) * moving
        tensors = sender.encode(model, 1, iteration)
        lost = iteration < lossy_updates and bool(torch.rand(1, generator=generator) < 0.1)
        node.mix_(torch.zeros(numel), {1: 0.5}, {} if lost else {1: node.decode(tensors, 1, iteration)})
        stale = node.stale.get(1, torch.zeros(numel, dtype=torch.bool))
        assert torch.equal(node.estimates[1][~stale], sender.own[~stale])
        shares.append(float(stale.float().mean()))
    return shares


def test_once_updates_arrive_again_every_value_is_back_in_step_within_a_sweep_of_the_window():
    sweep = math.ceil(1 / WINDOW_SHARE)  # messages for the window to pass every position
    shares = _out_of_step(alpha=0.05, updates=150 + sweep, lossy_updates=150, still=0.5)
    assert max(shares[:150]) == 1.0  # whole updates were lost: everything out of step then
    # values that never change are never picked by top-k again (without the window about half stay
    # out for good, 0.50 here): only the window brings them back
    assert shares[149] > 0.25 and shares[-1] == 0.0
