"""FlatState: the model's tensors are views of one state vector; snapshots are pooled."""

import torch
from torch import nn

from meshlearn.flat import SEGMENT_BYTES, FlatState
from meshlearn.models import build_model


class _Done:
    def __init__(self, done):
        self.done = done


def test_parameters_and_float_buffers_live_in_the_state_vector():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flat = FlatState(model)
    assert flat.params.numel() == 3 * 4 + 4 + 4 + 4 + 4 * 2 + 2
    assert flat.buffers.numel() == 8  # running mean and var; num_batches_tracked stays out
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    flat.state.fill_(0.5)
    assert float(model[0].weight.detach()[0, 0]) == 0.5 and float(model[1].running_var[0]) == 0.5
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 3)).sum().backward()
    optimizer.step()
    assert torch.equal(flat.params[:12].view(4, 3), model[0].weight)
    assert int(model[1].num_batches_tracked) == 1


def test_segments_cover_the_state_and_round_trip():
    flat = FlatState(build_model("resnet18", (3, 32, 32), 10))
    segments = flat.tensors()
    assert len(segments) == -(-flat.nbytes // SEGMENT_BYTES)
    assert sum(t.numel() for t in segments.values()) == flat.state.numel()
    snapshot = flat.snapshot()
    other = FlatState(build_model("resnet18", (3, 32, 32), 10))
    assert other.check_compatible(snapshot) is None
    other.load(snapshot)
    assert torch.equal(other.state, flat.state)
    assert FlatState(build_model("lenet", (3, 32, 32), 10)).check_compatible(snapshot) is not None


def test_snapshot_buffers_are_reused_only_when_released_and_done():
    flat = FlatState(nn.Linear(10, 10))
    first = flat.snapshot()
    flat.release(first, _Done(False))
    second = flat.snapshot()  # the first is still being sent
    assert second["state.0"].data_ptr() != first["state.0"].data_ptr()
    flat.release(second, _Done(True))
    third = flat.snapshot()
    assert third["state.0"].data_ptr() == second["state.0"].data_ptr()
    flat.state.fill_(2.0)
    assert float(third["state.0"][0]) != 2.0  # a copy, not a view
