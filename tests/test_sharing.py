"""Sharing schemes: what a node sends of its model, what its neighbours read back and average."""

import csv
import json

import pytest
import torch

from meshlearn.config import make_config
from meshlearn.definitions.averaging import masked_average_
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.errors import ConfigError
from meshlearn.sharing import make_sharing
from meshlearn.sharing.base import pack_bits, unpack_bits
from meshlearn.sim import simulate
from meshlearn.wire import Kind, Message, decode, encode


def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def _bucket(low, step, codes):
    """One bucket of a quantized message: its low end and step, then ``codes`` bytes of codes."""
    return torch.cat([_t([low, step]).view(torch.uint8), torch.zeros(codes, dtype=torch.uint8)])


def _over_the_wire(tensors):
    """The tensors as a receiver gets them: encoded into frames and decoded (no pickle)."""
    return decode(encode(Message(Kind.MODEL, 1, 7, 3, tensors))).tensors


# --- what is sent ---------------------------------------------------------------------------------


def test_topk_sends_the_values_that_changed_most_since_the_last_average():
    scheme = make_sharing("topk:0.2", 10, torch.float32, seed=1)
    scheme.start(torch.zeros(10))
    model = _t([0.1, -5, 0.3, 2, 0, 0, 0, 0, 0, 0.5])
    sent = _over_the_wire(scheme.encode(model, 1, 7))
    # 2 values; 2 int32 indices (8 bytes) cost more than a 2-byte bitmap of 10 positions: bits 1 and 3
    assert torch.equal(sent["values"], _t([-5, 2])) and torch.equal(sent["bitmap"], _t([0b1010, 0], torch.uint8))
    shared = scheme.decode(sent, 1, 7)
    assert torch.equal(shared.values, _t([0, -5, 0, 2, 0, 0, 0, 0, 0, 0]))
    assert shared.mask.tolist() == [False, True, False, True] + [False] * 6
    scheme.averaged(_t([0.1, -5, 0.3, 2, 0, 0, 0, 0, 0, 0]))  # the change is now counted from here
    assert torch.equal(scheme.encode(_t([0.1, -5, 0.3, 2, 0, 0, 0, 0, 0, 0.5]) + _t([0] * 9 + [3]), 1, 8)["values"],
                       _t([0, 3.5]))  # position 9 moved most; position 4's |0| ties and comes first


def test_topk_of_a_large_model_sends_int32_indices():
    scheme = make_sharing("topk:0.001", 100_000, torch.float32, seed=1)
    model = torch.zeros(100_000)
    model[[5, 70_000, 99_999]] = _t([1, -2, 3])
    scheme.start(torch.zeros(100_000))
    sent = scheme.encode(model, 0, 0)
    assert sent["indices"].dtype == torch.int32 and sent["indices"].numel() == 100  # 100 * 4 bytes < 12,500
    assert {5, 70_000, 99_999} <= set(sent["indices"].tolist())
    assert sum(t.nbytes for t in sent.values()) == scheme.wire_bytes() == 800


def test_subsampling_sends_values_only_at_positions_every_receiver_draws_itself():
    scheme = make_sharing("subsample:0.25", 40, torch.float32, seed=5)
    model = torch.arange(40, dtype=torch.float32)
    sent = _over_the_wire(scheme.encode(model, 3, 9))
    assert list(sent) == ["values"] and sent["values"].numel() == 10  # no positions on the wire
    receiver = make_sharing("subsample:0.25", 40, torch.float32, seed=5)  # another node, same run
    shared = receiver.decode(sent, 3, 9)
    assert torch.equal(shared.values[shared.mask], sent["values"])
    assert torch.equal(shared.values[shared.mask], model[shared.mask])  # the values of those positions
    assert not torch.equal(receiver.positions(3, 9), receiver.positions(3, 10))  # new positions each iteration
    assert not torch.equal(receiver.positions(3, 9), receiver.positions(4, 9))  # and each sender


def test_quantization_by_hand_and_unbiased():
    scheme = make_sharing("quantize:2", 4, torch.float32, seed=1)
    sent = _over_the_wire(scheme.encode(_t([0, 1, 2, 3]), 0, 0))
    # one bucket: low 0, 3 levels of step 1, then codes 0 1 2 3 packed 4 to a byte, low bits first
    assert torch.equal(sent["buckets"][:8].view(torch.float32), _t([0, 1]))
    assert sent["buckets"][8] == 0 | 1 << 2 | 2 << 4 | 3 << 6 and sent["buckets"].numel() == 8 + 512 // 4
    assert torch.equal(scheme.decode(sent, 0, 0).values, _t([0, 1, 2, 3]))
    one_bit = make_sharing("quantize:1", 1000, torch.float32, seed=1)
    model = torch.rand(1000, generator=torch.Generator().manual_seed(0))
    draws = torch.stack([one_bit.decode(one_bit.encode(model, 0, i), 0, i).values for i in range(400)])
    assert all(len(draw[:512].unique()) <= 2 for draw in draws)  # one bit: a bucket's low end or high end
    assert float((draws.mean(0) - model).abs().mean()) < 0.03  # stochastic rounding is unbiased


def test_bits_pack_and_unpack():
    for bits in (1, 2, 4, 8):
        codes = torch.randint(0, 1 << bits, (37,))
        assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, 37), codes)


# --- what is averaged ------------------------------------------------------------------------------


def test_partial_models_are_averaged_per_value_over_those_who_sent_it():
    own = torch.ones(4)
    a = (0.25, 3, _t([3, 3, 0, 0]), torch.tensor([True, True, False, False]))
    b = (0.25, 3, _t([0, 5, 5, 0]), torch.tensor([False, True, True, False]))
    state = own.clone()
    masked_average_(state, 0.5, [a, b], MISSING_CHUNK_RULES["per-chunk"])
    # value 0: the node (0.5) and a (0.25), renormalised; value 1: everyone; value 3: the node alone
    assert torch.allclose(state, _t([(0.5 + 0.75) / 0.75, 0.5 + 0.75 + 1.25, (0.5 + 1.25) / 0.75, 1]))
    state = own.clone()
    masked_average_(state, 0.5, [a, b], MISSING_CHUNK_RULES["fill-local"])  # 1/(1+max(2, 3)): the rest is own
    assert torch.allclose(state, _t([0.75 + 0.75, 0.5 + 0.75 + 1.25, 0.75 + 1.25, 1]))


def test_choco_sends_compressed_differences_and_steps_toward_the_estimates():
    node = make_sharing("choco:0.5:0.5", 4, torch.float32, seed=1)
    sent = _over_the_wire(node.encode(_t([4, -3, 1, 0]), 0, 0))
    # the top half of the difference to its estimate (0), which takes it in: sent as the estimate's new values
    assert torch.equal(node.own, _t([4, -3, 0, 0])) and torch.equal(sent["values"], _t([4, -3]))
    neighbour = make_sharing("choco:0.5:0.5", 4, torch.float32, seed=1)
    update = node.decode(_over_the_wire(neighbour.encode(_t([0, 0, 2, 2]), 1, 0)), 1, 0)
    state = _t([4, -3, 1, 0])
    assert node.mix_(state, {1: 0.25, 2: 0.25}, {1: update}) == [2]  # 2's update is missing: out of step
    # x += gamma * w * (xhat_1 - xhat_own) = 0.125 * ([0, 0, 2, 2] - [4, -3, 0, 0])
    assert torch.allclose(state, _t([3.5, -2.625, 1.25, 0.25]))
    again = state.clone()
    # 2's values 2 and 3 are in step again (sent), and 0 (the window of iteration 0, one value of 4); 1 is not
    node.mix_(again, {1: 0.25, 2: 0.25}, {1: update, 2: update})
    assert torch.allclose(again, state + 0.125 * (_t([0, 0, 2, 2]) - _t([4, -3, 0, 0])) + 0.125 * _t([-4, 0, 2, 2]))
    assert torch.equal(node.estimates[1], _t([0, 0, 2, 2]))  # the values sent again are taken, not added


def test_choco_over_lost_chunks_leaves_out_the_values_whose_update_may_be_lost_until_they_are_sent_again():
    sender, node = (make_sharing("choco:0.5:1", 8, torch.float32, seed=1, lossy=True) for _ in range(2))
    sender.encode(_t([0, 1, 0, 2, 0, 3, 0, 4]), 1, 0)  # positions 1, 3, 5, 7
    state = torch.zeros(8)
    assert node.mix_(state, {1: 0.5}, {}) == [1]  # its update missed: every value out of step
    # the same positions, as 4 pairs of 8 bytes, then the window of iteration 1 (position 1, 4 bytes)
    tensors = sender.encode(_t([0, 2, 0, 3, 0, 4, 0, 9]), 1, 1)
    middle_lost = node.receive(tensors, 1, 1, (_t([1, 0, 0, 1, 1]).bool(), 8))
    assert torch.nonzero(middle_lost.mask).flatten().tolist() == [1, 7]
    assert torch.nonzero(middle_lost.unsure).flatten().tolist() == [2, 3, 4, 5, 6]
    node.mix_(state, {1: 0.5}, {1: middle_lost})
    assert torch.equal(state, 0.5 * _t([0, 2, 0, 0, 0, 0, 0, 9]))  # 1 and 7 back in step; 3 and 5 not yet
    node.mix_(state, {1: 0.5}, {1: node.decode(tensors, 1, 1)})
    assert torch.equal(state, 0.5 * _t([0, 4, 0, 3, 0, 4, 0, 18]))  # all four in step; 0, 2, 4 and 6 never sent


def test_choco_skips_a_neighbour_whose_estimate_is_too_far_from_its_own_to_average():
    node = make_sharing("choco:1", 2, torch.float32, seed=1)
    node.encode(_t([-3e38, -3e38]), 0, 0)
    huge = node.decode({"values": _t([3e38, 3e38]), "bitmap": _t([3], torch.uint8), "window": _t([3e38])}, 1, 0)
    state = _t([1, 2])
    assert node.mix_(state, {1: 0.5}, {1: huge}) == []  # 6e38 apart: past float's range
    assert torch.equal(state, _t([1, 2]))


# --- what is refused -------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme,tensors,problem", [
    ("topk:0.2", {"values": _t([1, 2]), "bitmap": _t([0b1000, 4], torch.uint8)}, "past the end"),
    ("topk:0.2", {"values": _t([1, 2]), "bitmap": _t([0b1110, 0], torch.uint8)}, "3 positions for 2 values"),
    ("topk:0.2", {"values": _t([1, float("nan")]), "bitmap": _t([0b1010, 0], torch.uint8)}, "NaN"),
    ("topk:0.2", {"values": _t([1, 2], torch.float64), "bitmap": _t([0b1010, 0], torch.uint8)}, "float64"),
    ("topk:0.2", {"values": _t([1, 2])}, "expected tensors"),
    ("topk:0.0001", {"values": _t([1]), "indices": _t([10_000], torch.int32)}, "inside 0 .. 9999"),
    ("topk:0.0002", {"values": _t([1, 2]), "indices": _t([5, 5], torch.int32)}, "rise strictly"),
    ("topk:0.0002", {"values": _t([1, 2]), "indices": _t([-1, 5], torch.int32)}, "rise strictly"),
    ("subsample:0.2", {"values": _t([1, 2, 3])}, "expected torch.float32 \\[2\\]"),
    ("quantize:8", {"buckets": _bucket(0, -1, 512)}, "negative"),
    ("quantize:8", {"buckets": _bucket(float("inf"), 1, 512)}, "NaN or Inf"),
    ("quantize:8", {"buckets": _bucket(0, 1, 256)}, "expected torch.uint8 \\[520\\]"),
    ("full", {"values": torch.zeros(9)}, "expected torch.float32 \\[10\\]"),
])
def test_a_bad_share_is_refused_with_what_is_wrong(scheme, tensors, problem):
    numel = 10_000 if scheme.startswith("topk:0.000") else 10
    with pytest.raises(ValueError, match=problem):
        make_sharing(scheme, numel, torch.float32, seed=1).decode(tensors, 1, 0)


@pytest.mark.parametrize("values,message", [
    ({"sharing": "topk"}, "write it topk:ALPHA"), ({"sharing": "topk:1.5"}, "in \\(0, 1\\]"),
    ({"sharing": "quantize:3"}, "BITS must be one of 1, 2, 4, 8"),
    ({"sharing": "topk:0.1", "algorithm": "gossip"}, "needs algorithm dpsgd"),
    ({"sharing": "topk:0.1", "aggregation": "median"}, "needs aggregation mean"),
    ({"sharing": "choco:0.1", "byzantine": "1:stale"}, "no byzantine"),
])
def test_a_sharing_that_cannot_be_run_is_one_clear_error(values, message):
    with pytest.raises(ConfigError, match=message):
        make_config(values)


def test_a_users_own_scheme_is_named_like_a_built_in_one_and_an_unknown_one_is_refused_before_start(tmp_path):
    from meshlearn.sim.checks import check_before_start

    with pytest.raises(ConfigError, match="unknown sharing scheme 'zip'"):
        check_before_start(make_config({"sharing": "zip"}))
    module = tmp_path / "halves.py"
    module.write_text(
        "import torch\n"
        "from meshlearn.sharing import Shared, register_sharing\n"
        "from meshlearn.sharing.full import FullSharing\n\n"
        "@register_sharing\n"
        "class FirstPart(FullSharing):\n"
        "    name = 'first-part'\n"
        "    def __init__(self, numel, dtype, seed, share):\n"
        "        super().__init__(numel, dtype, seed)\n"
        "        self.count = int(numel * float(share))\n"
        "    def encode(self, vector, sender, iteration):\n"
        "        return {'values': vector.detach()[:self.count].clone()}\n"
        "    def decode(self, tensors, sender, iteration):\n"
        "        values, mask = torch.zeros(self.numel), torch.zeros(self.numel, dtype=torch.bool)\n"
        "        values[:self.count], mask[:self.count] = tensors['values'], True\n"
        "        return Shared(values, mask)\n")
    summaries = {}
    for scheme in ("full", "first-part:0.5"):
        config = make_config({"engine": "batched", "nodes": 4, "dataset": "digits", "iterations": 5, "test_after": 5,
                              "step_time": 0.001, "sharing": scheme, "models_module": str(module),
                              "output": str(tmp_path / scheme)})
        check_before_start(config)
        simulate(config, progress=False)
        summaries[scheme] = json.loads((tmp_path / scheme / "summary.json").read_text())
    assert summaries["first-part:0.5"]["bytes_sent"] == pytest.approx(summaries["full"]["bytes_sent"] / 2, rel=1e-3)


# --- lost chunks (UDP) -----------------------------------------------------------------------------

OVER_UDP = ["subsample:0.1", "topk:0.1", "quantize:4", "choco:0.1"]


@pytest.mark.parametrize("scheme", OVER_UDP)
def test_a_share_that_lost_chunks_keeps_bit_for_bit_what_its_rule_can_place_and_marks_the_rest(scheme):
    numel, chunk_bytes = 10_000, 256
    generator = torch.Generator().manual_seed(3)
    sender, receiver = (make_sharing(scheme, numel, torch.float32, seed=1, lossy=True) for _ in range(2))
    tensors = sender.encode(torch.randn(numel, generator=generator), 5, 2)
    layout = sender.layout()
    assert layout.nbytes == sum(t.nbytes for t in tensors.values()) == sender.wire_bytes()
    assert sorted(tensors) == sorted(s.name for s in layout.segments)
    whole = receiver.decode(tensors, 5, 2)
    sent = torch.ones(numel, dtype=torch.bool) if whole.mask is None else whole.mask
    chunks = -(-layout.nbytes // chunk_bytes)
    everything = receiver.receive(layout.received(tensors, torch.ones(chunks, dtype=torch.bool), chunk_bytes), 5, 2,
                                  (torch.ones(chunks, dtype=torch.bool), chunk_bytes))
    assert torch.equal(everything.values, whole.values)
    kept = []
    for _ in range(6):
        present = torch.rand(chunks, generator=generator) < 0.7
        present[0] = False  # at least one chunk lost
        share = receiver.receive(layout.received(tensors, present, chunk_bytes), 5, 2, (present, chunk_bytes))
        assert not bool((share.mask & ~sent).any())  # nothing read where nothing was sent
        assert torch.equal(share.values[share.mask], whole.values[share.mask])  # what was, bit for bit
        assert not bool(share.values[~share.mask].any())
        if share.unsure is not None:  # every value sent is read or marked unsure
            assert not bool((sent & ~share.mask & ~share.unsure).any()) and not bool((share.mask & share.unsure).any())
        kept.append(int(share.mask.sum()) / int(sent.sum()))
    assert 0 < sum(kept) / len(kept) < 1, kept


def _pairs(positions, values):
    """A lossy sparse message: each int32 position, then its float32 value."""
    return {"pairs": torch.stack([_t(positions, torch.int32), _t(values).view(torch.int32)], 1).view(torch.uint8).view(-1)}


def test_sparse_shares_over_udp_send_each_position_beside_its_value_and_check_what_arrived():
    over_tcp, over_udp = (make_sharing("topk:0.1", 100, torch.float32, seed=1, lossy=lossy) for lossy in (False, True))
    model = torch.arange(100.0)
    assert sorted(over_tcp.encode(model, 0, 0)) == ["bitmap", "values"]
    assert torch.equal(over_udp.encode(model, 0, 0)["pairs"], _pairs(range(90, 100), range(90, 100))["pairs"])
    assert over_udp.wire_bytes() == 10 * 8
    arrived = {"pairs": torch.tensor([True] * 16 + [False] * 16 + [True] * 48)}  # the 3rd and 4th pairs lost
    share = over_udp.decode_partial(_pairs(range(90, 100), range(10)), arrived, 0, 0)
    assert torch.nonzero(share.mask).flatten().tolist() == [90, 91, 94, 95, 96, 97, 98, 99]
    assert torch.nonzero(share.unsure).flatten().tolist() == [92, 93]  # between the pairs around the lost ones
    assert over_tcp.decode_partial(over_tcp.encode(model, 0, 0), {}, 0, 0) is None  # a bitmap: lost whole
    with pytest.raises(ValueError, match="rise strictly"):
        over_udp.decode_partial(_pairs([90, 91, 0, 0, 5, 95, 96, 97, 98, 99], range(10)), arrived, 0, 0)
    with pytest.raises(ValueError, match="inside 0 .. 99"):
        over_udp.decode(_pairs(range(91, 101), range(10)), 0, 0)


def test_a_share_crossing_real_udp_with_lost_datagrams_arrives_as_the_batched_engine_models_it():
    from helpers.pairs import connected

    from meshlearn.netem import Emulator, NetemSpec
    from meshlearn.transport.udp import UdpSettings, UdpTransport

    scheme = make_sharing("choco:0.1", 20_000, torch.float32, seed=1, lossy=True)
    layout, chunk_bytes = scheme.layout(), 512
    a, b = connected(*(UdpTransport(i, layout=layout, settings=UdpSettings(chunk_bytes=chunk_bytes, late_chunks="drop"))
                       for i in range(2)))
    a.sender.emulator = Emulator(NetemSpec(loss=0.3), seed=4)
    try:
        tensors = scheme.encode(torch.randn(20_000, generator=torch.Generator().manual_seed(2)), 0, 0)
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, tensors))
        got = b.gather(0, [0], timeout=0.5)[0]
        assert 0 < got.chunks.missing < len(got.chunks.present)
        modelled = layout.received(tensors, got.chunks.present, chunk_bytes)
        assert all(torch.equal(got.tensors[name], modelled[name]) for name in modelled)
    finally:
        a.close()
        b.close()


# --- a quick run -----------------------------------------------------------------------------------


def test_quick_digits_runs_of_every_scheme_send_what_they_should_and_keep_the_accuracy(tmp_path):
    summaries = {}
    for scheme in ("full", "topk:0.1", "subsample:0.1", "quantize:8", "choco:0.1"):
        config = make_config({"engine": "batched", "nodes": 8, "dataset": "digits", "iterations": 120, "lr": 0.1,
                              "test_after": 120, "step_time": 0.001, "seed": 1, "sharing": scheme,
                              "output": str(tmp_path / scheme)})
        simulate(config, progress=False)
        summaries[scheme] = json.loads((tmp_path / scheme / "summary.json").read_text())
    full = summaries["full"]
    assert full["final"]["accuracy"] > 0.9
    for scheme in ("topk:0.1", "subsample:0.1", "choco:0.1"):  # positions included (top-k: a bitmap)
        assert summaries[scheme]["bytes_per_iteration"] <= 0.15 * full["bytes_per_iteration"], scheme
    # 8 bits a value, plus a low end and a step per bucket of 512 values
    assert summaries["quantize:8"]["bytes_per_iteration"] <= 0.26 * full["bytes_per_iteration"]
    for scheme, summary in summaries.items():
        assert summary["final"]["accuracy"] >= full["final"]["accuracy"] - 0.02, scheme
        # accuracy against bytes: summary.csv's last row has what each node sent in the run
        last = list(csv.DictReader((tmp_path / scheme / "summary.csv").open()))[-1]
        assert float(last["mb_sent_mean"]) * 1e6 == pytest.approx(summary["bytes_sent"] / 8), scheme
