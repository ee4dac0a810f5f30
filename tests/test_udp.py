"""UDP: datagram codec, chunking, per-chunk averaging, emulation, and training under loss."""

import json
import socket
import struct
import threading
import time

import pytest
import torch
from helpers.pairs import connected
from helpers.waiting import wait_until
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshlearn.clock import FakeClock
from meshlearn.config import make_config
from meshlearn.definitions.dpsgd import MISSING_CHUNK_RULES
from meshlearn.errors import ConfigError, WireError
from meshlearn.flat import FlatState
from meshlearn.layout import TensorLayout
from meshlearn.models import build_model
from meshlearn.netem import DelayLine, Emulator, NetemSpec
from meshlearn.node import build_node
from meshlearn.node.algorithms.dpsgd import chunked_average_
from meshlearn.sim import simulate
from meshlearn.sim.inprocess import run_threads
from meshlearn.topology import build_topology
from meshlearn.transport.base import MAX_PENDING_PER_SENDER, TransportStats
from meshlearn.transport.udp import (
    DatagramSender,
    Reassembler,
    UdpSettings,
    UdpTransport,
)
from meshlearn.wire import Chunks, Kind, Message
from meshlearn.wire.datagram import (
    HEADER_SIZE,
    ChunkHeader,
    chunk_count,
    pack_header,
    parse_datagram,
)
from meshlearn.wire.sealed_datagram import DatagramSeal


def _datagram(index=1, count=3, chunk=8, total=20, payload=None, kind=Kind.MODEL):
    header = ChunkHeader(kind, 4, 9, index, count, chunk, 3, total)
    payload = payload if payload is not None else bytes(range(header.payload_size()))
    return pack_header(header, [memoryview(payload)]) + payload


def test_header_round_trip():
    data = _datagram(index=2, payload=b"abcd")
    header, payload = parse_datagram(memoryview(data), max_total=1000)
    assert (header.kind, header.sender, header.iteration, header.index, header.count, header.degree) == \
        (Kind.MODEL, 4, 9, 2, 3, 3)
    assert bytes(payload) == b"abcd" and len(data) == HEADER_SIZE + 4


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d[:10], "shorter than"),
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:4] + b"\x09" + d[5:], "version"),
    (lambda d: d[:5] + b"\x63" + d[6:], "unknown message kind"),
    (lambda d: d[:6] + b"\x80" + d[7:], "flags"),
    (lambda d: d[:-1], "carries 7 bytes"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    (lambda d: d[:28] + struct.pack("<I", 5) + d[32:], "does not fit"),
], ids=["short", "magic", "version", "kind", "flags", "truncated", "corrupt", "count"])
def test_malformed_datagrams_rejected(mutate, match):
    with pytest.raises(WireError, match=match):
        parse_datagram(memoryview(mutate(_datagram())), max_total=1000)


def test_size_cap_on_datagrams():
    with pytest.raises(WireError, match="size cap"):
        parse_datagram(memoryview(_datagram()), max_total=19)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=120), st.integers(0, 80), st.integers(1, 255))
def test_fuzz_datagrams_only_raise_wire_error(noise, position, flip):
    for data in (noise, bytearray(_datagram())):
        if isinstance(data, bytearray) and position < len(data):
            data[position] ^= flip
        try:
            parse_datagram(memoryview(bytes(data)), max_total=1 << 20)
        except WireError:
            pass


def _pair(layout, **settings):
    return connected(UdpTransport(0, layout=layout, settings=UdpSettings(**settings)),
                     UdpTransport(1, layout=layout, settings=UdpSettings(**settings)))


@pytest.fixture
def lenet_state():
    torch.manual_seed(0)
    flat = FlatState(build_model("lenet", (3, 32, 32), 10))
    return flat, TensorLayout.uniform(flat.ranges, flat.state.dtype)


@pytest.mark.parametrize("chunk_bytes", [1424, 4000, 60000])
def test_chunked_model_reassembles_bit_identical(lenet_state, chunk_bytes):
    flat, layout = lenet_state
    a, b = _pair(layout, chunk_bytes=chunk_bytes)
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        got = b.gather(0, [0], timeout=10)
        assert got[0].chunks.missing == 0
        assert got[0].chunks.present.numel() == chunk_count(flat.nbytes, chunk_bytes)
        assert torch.equal(got[0].chunks.vector, flat.state)
        for name, tensor in flat.tensors().items():
            assert torch.equal(got[0].tensors[name], tensor)
        assert b.extra_stats()["rcvbuf_drops"] == 0 and b.reassembler.chunks_lost == 0
    finally:
        a.close()
        b.close()


def test_datagrams_read_into_a_guessed_slot_never_corrupt_the_model(lenet_state):
    # The receiver reads each datagram into the slot of the chunk after the last one received.
    # Feed it wrong guesses: a corrupted chunk, an oversized one, chunks out of order.
    flat, layout = lenet_state
    a, b = _pair(layout, chunk_bytes=1424)
    raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        data = memoryview(flat.state.numpy()).cast("B")
        count = chunk_count(flat.nbytes, 1424)
        target = b.address.removeprefix("udp://").rpartition(":")
        target = (target[0], int(target[2]))

        def chunk(index, iteration=0):
            header = ChunkHeader(Kind.MODEL, 0, iteration, index, count, 1424, 1, flat.nbytes)
            payload = bytes(data[index * 1424:index * 1424 + header.payload_size()])
            return pack_header(header, [memoryview(payload)]) + payload

        corrupted = bytearray(chunk(1))
        corrupted[-1] ^= 0xFF
        # (whole copies of the refused chunks 1 and 2 come before the last chunk: once every chunk is
        # in or refused, a gather waits no more)
        order = [chunk(0), bytes(corrupted), chunk(3), chunk(2) + b"extra", chunk(2, iteration=1)]
        order += [chunk(2), chunk(1)] + [chunk(i) for i in range(4, count)]
        for datagram in order:
            raw.sendto(datagram, target)
        got = b.gather(0, [0], timeout=10)
        assert got[0].chunks.missing == 0
        assert torch.equal(got[0].chunks.vector, flat.state)
        assert b.stats.malformed_dropped == 2
        lone = b.gather(1, [0], timeout=0.1)[0]  # iteration 1 got chunk 2 only
        assert lone.chunks.present.nonzero().flatten().tolist() == [2]
        assert torch.equal(lone.chunks.vector[2 * 356:3 * 356], flat.state[2 * 356:3 * 356])
    finally:
        raw.close()
        a.close()
        b.close()


def test_interleaved_senders_reassemble_bit_identical(lenet_state):
    flat, layout = lenet_state
    receiver = UdpTransport(9, layout=layout, settings=UdpSettings(chunk_bytes=1424))
    senders = [UdpTransport(i, layout=layout, settings=UdpSettings(chunk_bytes=1424)) for i in range(3)]
    models = [flat.state * (i + 1) for i in range(3)]
    try:
        address = receiver.bind()
        book = {i: s.bind() for i, s in enumerate(senders)}
        threads = [threading.Thread(target=s.connect, args=({9: address},)) for s in senders]
        for thread in threads:
            thread.start()
        receiver.connect(book)
        for thread in threads:
            thread.join()
        sending = [threading.Thread(target=s.broadcast, args=([9], Message(Kind.MODEL, i, 0, 1, flat.segments_of(m))))
                   for i, (s, m) in enumerate(zip(senders, models))]
        for thread in sending:
            thread.start()
        for thread in sending:
            thread.join()
        got = receiver.gather(0, [0, 1, 2], timeout=10)
        for i in range(3):
            assert got[i].chunks.missing == 0 and torch.equal(got[i].chunks.vector, models[i])
    finally:
        for transport in [receiver, *senders]:
            transport.close()


@pytest.mark.parametrize("late", [True, False])
def test_chunks_that_miss_their_deadline_fill_the_next_iteration(lenet_state, late):
    flat, layout = lenet_state
    a, b = _pair(layout, chunk_bytes=1424, late_chunks="use" if late else "drop")
    raw = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        models = {0: flat.state.clone(), 1: flat.state * -2, 2: flat.state * 3}
        count = chunk_count(flat.nbytes, 1424)
        per_chunk = 1424 // 4
        host, _, port = b.address.removeprefix("udp://").rpartition(":")

        def send(iteration, indices):
            data = memoryview(models[iteration].numpy()).cast("B")
            for index in indices:
                header = ChunkHeader(Kind.MODEL, 0, iteration, index, count, 1424, 1, flat.nbytes)
                payload = bytes(data[index * 1424:index * 1424 + header.payload_size()])
                raw.sendto(pack_header(header, [memoryview(payload)]) + payload, (host, int(port)))

        def settle():  # every datagram sent so far is read
            deadline = time.monotonic() + 5
            while b.datagrams_received < sent[0] and time.monotonic() < deadline:
                time.sleep(0.01)

        sent = [0]
        half = range(0, count, 2)
        send(0, half)
        sent[0] += len(half)
        settle()
        first = b.gather(0, [0], timeout=0.05)[0]
        assert first.chunks.missing == count - len(half)
        send(0, range(1, count))  # the rest of iteration 0 (and a duplicate of chunk 2), too late
        send(1, [0, 1])
        sent[0] += count - 1 + 2
        settle()
        second = b.gather(1, [0], timeout=0.05)[0]
        assert b.reassembler.chunks_lost == (count - len(half)) + (count - 2)
        if late:
            assert second.chunks.missing == 0 and b.reassembler.late_chunks_used == count - 2
            expected = models[0].clone()
            expected[:2 * per_chunk] = models[1][:2 * per_chunk]
            assert torch.equal(second.chunks.vector, expected)
            assert b.stats.stale_dropped == 0
        else:
            assert second.chunks.present.nonzero().flatten().tolist() == [0, 1]
            assert b.reassembler.late_chunks_used == 0 and b.stats.stale_dropped == count - 1
        send(0, [count - 1])  # two iterations late: dropped either way
        send(2, range(count))
        sent[0] += 1 + count
        settle()
        third = b.gather(2, [0], timeout=5)[0]
        assert third.chunks.missing == 0 and torch.equal(third.chunks.vector, models[2])
    finally:
        raw.close()
        a.close()
        b.close()


def test_sync_gather_returns_as_soon_as_complete_and_async_does_not_wait(lenet_state):
    flat, layout = lenet_state
    a, b = _pair(layout)
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        start = time.monotonic()
        assert 0 in b.gather(0, [0], timeout=30)
        assert time.monotonic() - start < 10  # far below the timeout
        assert b.gather(1, [0], timeout=0.3) == {}  # nothing sent: waits the timeout, counts it
        assert b.stats.gather_timeouts == 1
        b.mode = "async"
        start = time.monotonic()
        assert b.gather(2, [0], timeout=30) == {}
        assert time.monotonic() - start < 10 and b.stats.gather_timeouts == 1  # it did not wait the timeout
    finally:
        a.close()
        b.close()


def _partial(vector, present, chunk_elems, degree):
    return Message(Kind.MODEL, 0, 0, degree, chunks=Chunks(chunk_elems * 4, present, vector))


@pytest.mark.parametrize("rule", ["per-chunk", "fill-local"])
def test_identical_models_stay_identical_under_any_loss(rule):
    generator = torch.Generator().manual_seed(1)
    model = torch.randn(1000, generator=generator)
    for trial in range(20):
        state = model.clone()
        received = []
        for j in range(3):
            present = torch.rand(13, generator=generator) < 0.5
            present[0] = trial % 2 == 0 or bool(present[0])
            degree = int(torch.randint(1, 5, (1,)))
            received.append((1 / (1 + max(3, degree)), _partial(model.clone(), present, 80, degree)))
        chunked_average_(state, 1 - sum(w for w, _ in received), received, MISSING_CHUNK_RULES[rule])
        assert torch.allclose(state, model, atol=1e-6)


def test_no_loss_per_chunk_equals_metropolis_hastings():
    generator = torch.Generator().manual_seed(2)
    own, others = torch.randn(500, generator=generator), [torch.randn(500, generator=generator) for _ in range(3)]
    degrees = [3, 2, 4]  # mine is 3
    expected = own.clone()
    weights = [1 / (1 + max(3, d)) for d in degrees]
    expected = (1 - sum(weights)) * own + sum(w * o for w, o in zip(weights, others))
    for rule in ("per-chunk", "fill-local"):
        state = own.clone()
        msgs = [(w, _partial(o, torch.ones(7, dtype=torch.bool), 80, d)) for w, o, d in zip(weights, others, degrees)]
        chunked_average_(state, 1 - sum(weights), msgs, MISSING_CHUNK_RULES[rule])
        assert torch.allclose(state, expected, atol=1e-6)


def test_lost_chunk_takes_weights_from_arrived_neighbours_only():
    own = torch.zeros(8)
    a, b = torch.full((8,), 4.0), torch.full((8,), 8.0)
    present_a = torch.tensor([True, True])
    present_b = torch.tensor([True, False])  # b's second chunk (elements 4..7) lost
    msgs = [(1 / 3, _partial(a, present_a, 4, 1)), (1 / 3, _partial(b, present_b, 4, 1))]
    state = own.clone()
    chunked_average_(state, 1 / 3, msgs, MISSING_CHUNK_RULES["per-chunk"])
    assert torch.allclose(state[:4], torch.full((4,), 4.0))  # (0 + 4 + 8) / 3
    assert torch.allclose(state[4:], torch.full((4,), 2.0))  # (0 + 4) / 2: b's missing chunk counts for nobody
    state = own.clone()
    chunked_average_(state, 1 / 3, msgs, MISSING_CHUNK_RULES["fill-local"])
    assert torch.allclose(state[4:], torch.full((4,), 4 / 3))  # b's chunk replaced by the local 0


def test_per_chunk_loss_in_a_regular_graph_biases_toward_neither_side():
    # 3-regular: every Metropolis-Hastings weight is 1/4. One neighbour's second chunk is lost:
    # that chunk is the plain mean of the node and the two neighbours that delivered it.
    own = torch.zeros(8)
    values = [torch.full((8,), v) for v in (3.0, 6.0, 9.0)]
    presence = [torch.tensor([True, True]), torch.tensor([True, True]), torch.tensor([True, False])]
    msgs = [(0.25, _partial(v, p, 4, 3)) for v, p in zip(values, presence)]
    state = own.clone()
    chunked_average_(state, 0.25, msgs, MISSING_CHUNK_RULES["per-chunk"])
    assert torch.allclose(state[:4], torch.full((4,), 18 / 4))
    assert torch.allclose(state[4:], torch.full((4,), 9 / 3))
    state = own.clone()
    # the study's rule: the lost quarter goes to the node
    chunked_average_(state, 0.25, msgs, MISSING_CHUNK_RULES["fill-local"])
    assert torch.allclose(state[4:], torch.full((4,), 9 / 4))


def test_udp_dpsgd_without_loss_equals_tcp():
    results = {}
    for transport in ("tcp", "udp"):
        config = make_config({"nodes": 4, "topology": "ring", "rounds": 1, "iterations": 5, "test_after": 5,
                              "eval_samples": 20, "transport": transport, "udp_timeout": 10, "seed": 4,
                              "chunk_bytes": 1424})
        graph = build_topology(config.topology, config.nodes, config.seed)
        nodes = [build_node(config, rank, graph) for rank in range(config.nodes)]
        run_threads(nodes, timeout=120)
        results[transport] = torch.stack([n.flat.state.clone() for n in nodes])
    assert torch.allclose(results["tcp"], results["udp"], atol=1e-6)


def test_emulated_loss_rate_and_correlation():
    emulator = Emulator(NetemSpec(loss=0.3, corr=0.25), seed=3)
    drops = [emulator.drop() for _ in range(40_000)]
    rate = sum(drops) / len(drops)
    assert abs(rate - 0.3) < 0.02
    after_drop = [b for a, b in zip(drops, drops[1:]) if a]
    assert sum(after_drop) / len(after_drop) == pytest.approx(0.25 + 0.3 * 0.75, abs=0.03)


def test_emulated_loss_on_real_datagrams(lenet_state):
    flat, layout = lenet_state
    a, b = _pair(layout, chunk_bytes=1424)
    a.sender.emulator = Emulator(NetemSpec(loss=0.3), seed=5)
    try:
        for iteration in range(5):
            a.broadcast([1], Message(Kind.MODEL, 0, iteration, 1, flat.snapshot()))
        got = [b.gather(i, [0], timeout=0.5) for i in range(5)]
        expected = 5 * chunk_count(flat.nbytes, 1424)
        lost = sum(m[0].chunks.missing for m in got if 0 in m) + sum(
            chunk_count(flat.nbytes, 1424) for m in got if 0 not in m)
        assert abs(lost / expected - 0.3) < 0.05
        assert a.sender.emulated_drops == lost
    finally:
        a.close()
        b.close()


def test_lost_chunks_read_as_zeros_even_in_a_recycled_buffer(lenet_state):
    flat, layout = lenet_state
    a, b = _pair(layout, chunk_bytes=1424)
    a.sender.emulator = Emulator(NetemSpec(loss=0.3), seed=5)
    try:
        b.recycle([Message(Kind.MODEL, 0, 0, 1, chunks=Chunks(1424, torch.ones(1, dtype=torch.bool),
                                                              torch.full((flat.state.numel(),), float("nan"))))])
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        got = b.gather(0, [0], timeout=0.5)[0]
        lost = ~got.chunks.present.repeat_interleave(1424 // 4)[:flat.state.numel()]
        assert got.chunks.missing > 0 and not got.chunks.vector.isnan().any()
        assert torch.equal(got.chunks.vector[lost], torch.zeros(int(lost.sum())))
        assert torch.equal(got.chunks.vector[~lost], flat.state[~lost])
    finally:
        a.close()
        b.close()


def test_emulated_delay_holds_datagrams_until_they_are_due():
    clock, sent = FakeClock(), []
    sender = DatagramSender(0, lambda pieces, addr: sent.append(b"".join(pieces)), 1424, 1e12,
                            Emulator(NetemSpec(delay=0.3), seed=5), Emulator(NetemSpec(), seed=5), TransportStats(),
                            clock=clock.monotonic, sleep=clock.sleep)
    model = torch.arange(1000, dtype=torch.float32)
    sender.send_model(Message(Kind.MODEL, 0, 7, 1, {"all": model}), [("127.0.0.1", 9)], 4000)
    count = chunk_count(4000, 1424)
    assert sent == [] and sender.pending == count  # all held by the delay line
    clock.advance(0.29)
    sender.release_due()
    assert sent == []
    clock.advance(0.02)
    sender.release_due()
    assert len(sent) == count and sender.pending == 0 and sender.datagrams_sent == count
    got = torch.empty(1000)
    for datagram in sent:
        header, payload = parse_datagram(memoryview(datagram), max_total=4000)
        memoryview(got.numpy()).cast("B")[header.index * 1424:header.index * 1424 + len(payload)] = payload
    assert header.iteration == 7 and torch.equal(got, model)


def test_a_udp_transport_under_emulated_delay_delivers_through_its_delay_thread(lenet_state):
    flat, layout = lenet_state
    a, b = connected(UdpTransport(0, layout=layout, netem=NetemSpec(delay=0.05)), UdpTransport(1, layout=layout))
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        got = b.gather(0, [0], timeout=10)
        assert got[0].chunks.missing == 0 and torch.equal(got[0].chunks.vector, flat.state)
        # the delay thread counts what it sent once its batch is out: the receiver may have it all first
        assert wait_until(lambda: a.sender.datagrams_sent >= chunk_count(flat.nbytes, a.chunk_bytes), timeout=5)
    finally:
        a.close()
        b.close()


def _tcp_pair(clock: FakeClock):
    """Two TCP transports on loopback, handshaken; node 1's emulated time on ``clock``."""
    from meshlearn.transport import TcpTransport
    from meshlearn.transport.settings import TcpSettings

    return connected(TcpTransport(0, settings=TcpSettings(wait_timeout=1, linger=1)),
                     TcpTransport(1, settings=TcpSettings(wait_timeout=1, linger=1), clock=clock.monotonic))


def test_tcp_emulated_delay_holds_a_message_until_it_is_due():
    clock = FakeClock()
    a, b = _tcp_pair(clock)
    b.emulator = Emulator(NetemSpec(delay=0.25), seed=1)  # from now on: the handshake is done
    try:
        a.send(1, Message(Kind.MODEL, 0, 0, 1, {"p": torch.ones(3)}))
        a.send(1, Message(Kind.MODEL, 0, 1, 1, {"p": torch.ones(3)}))
        deadline = time.monotonic() + 10
        while b.stats.messages_received < 3 and time.monotonic() < deadline:  # HELLO and both models arrive ...
            assert b.recv(0.05) is None  # ... and wait in the delay line
        assert b.stats.messages_received == 3
        clock.advance(0.24)
        assert b.recv(0.05) is None  # not due yet
        clock.advance(0.02)
        first, second = b.recv(0.05), b.recv(0.05)
        assert (first.iteration, second.iteration) == (0, 1)  # due, and in order (TCP never reorders)
    finally:
        a.close()
        b.close()


def test_a_delay_line_releases_items_when_due_and_keeps_order_where_asked():
    line = DelayLine()
    line.push("late", 2.0)
    line.push("early", 1.0)
    assert line.pop_due(0.5) == [] and line.next_due() == 1.0
    assert line.pop_due(1.5) == ["early"] and line.pop_due(2.0) == ["late"] and len(line) == 0
    ordered = DelayLine(keep_order=True)
    assert ordered.push("first", 2.0) == 2.0
    assert ordered.push("second", 1.0) == 2.0  # never before one pushed earlier
    assert ordered.pop_due(2.0) == ["first", "second"]


def test_net_spec_parsing():
    spec = NetemSpec.parse("loss=20%,corr=25%,delay=200ms,jitter=50ms")
    assert (spec.loss, spec.corr, spec.delay, spec.jitter) == (0.2, 0.25, 0.2, 0.05)
    for bad in ("loss=120%", "los=1%", "delay=fast", "loss"):
        with pytest.raises(ConfigError):
            NetemSpec.parse(bad)


@pytest.mark.slow  # the sharing experiment learns over lossy UDP in test_experiment, test_network_udp over real UDP
def test_six_nodes_udp_with_20_percent_loss_reach_85_percent(tmp_path):
    config = make_config({
        "nodes": 6, "topology": "regular:3", "transport": "udp", "net": "loss=20%", "udp_timeout": 0.2,
        "rounds": 2, "batch_size": 16, "iterations": 100, "test_after": 25, "seed": 11, "chunk_bytes": 4000,
        "output": str(tmp_path / "run"),
    })
    result = simulate(config, progress=False)
    summary = json.loads((result.output / "summary.json").read_text())
    stats = [node["stats"] for node in summary["per_node"].values()]
    assert summary["final"]["accuracy"] >= 0.85, (summary["final"], stats)
    assert sum(s["emulated_drops"] for s in stats) > 0 and sum(s["chunks_lost"] for s in stats) > 0
    assert all(s["rcvbuf_drops"] == 0 for s in stats)


# --- the pure cores, fed directly ------------------------------------------------------------

def _chunks_of(vector: torch.Tensor, sender: int, iteration: int, chunk: int = 16):
    """(header, payload) of every chunk of ``vector`` as sender ``sender`` would send it."""
    data = memoryview(vector.numpy()).cast("B")
    count = chunk_count(len(data), chunk)
    for index in range(count):
        payload = data[index * chunk:(index + 1) * chunk]
        yield ChunkHeader(Kind.MODEL, sender, iteration, index, count, chunk, 2, len(data)), payload


def test_a_reassembler_fed_out_of_order_and_duplicated_chunks_rebuilds_each_model():
    layout = TensorLayout.uniform({"all": (0, 12)}, torch.float32)  # 48 bytes: 3 chunks of 16
    reassembler = Reassembler(layout, chunk_bytes=16)
    first, second = torch.arange(12.0), -torch.arange(12.0)
    chunks = list(_chunks_of(first, sender=1, iteration=0)) + list(_chunks_of(second, sender=2, iteration=0))
    completed = [reassembler.add(header, payload)[0] for header, payload in reversed(chunks + chunks[:2])]
    assert completed.count(True) == 2  # each model completes once; duplicates change nothing
    assert reassembler.complete(1, 0) and reassembler.complete(2, 0)
    got, spare = reassembler.assemble(reassembler.take(0, [1, 2]))
    assert torch.equal(got[1].chunks.vector, first) and torch.equal(got[2].tensors["all"], second)
    assert reassembler.chunks_lost == 0 and spare == []


def test_a_reassembler_refuses_chunks_that_would_cut_a_value_in_two():
    layout = TensorLayout.uniform({"all": (0, 12)}, torch.float32)
    header, payload = next(_chunks_of(torch.arange(12.0), sender=1, iteration=0, chunk=12))  # 12: not a multiple of 8
    with pytest.raises(WireError, match="chunk size 12 is not a multiple of 8"):
        Reassembler(layout, chunk_bytes=16).add(header, payload)


def test_a_reassembler_marks_lost_chunks_fills_them_late_and_drops_stale_ones():
    layout = TensorLayout.uniform({"all": (0, 12)}, torch.float32)
    reassembler = Reassembler(layout, chunk_bytes=16, late=True)
    old, new = torch.full((12,), 1.0), torch.full((12,), 2.0)
    for header, payload in _chunks_of(new, 1, 1):
        if header.index != 1:
            reassembler.add(header, payload)  # iteration 1 loses its middle chunk
    got, _ = reassembler.assemble(reassembler.take(0, [1]))
    assert got == {} and reassembler.chunks_lost == 3  # nothing of iteration 0 came
    for header, payload in _chunks_of(old, 1, 0):
        reassembler.add(header, payload)  # iteration 0, one iteration late: kept
    got, spare = reassembler.assemble(reassembler.take(1, [1]))
    assert got[1].chunks.missing == 0 and reassembler.late_chunks_used == 1
    assert torch.equal(got[1].chunks.vector, torch.tensor([2.0] * 4 + [1.0] * 4 + [2.0] * 4))
    assert len(spare) == 1  # the late message's vector goes back to the pool
    reassembler.add(*next(_chunks_of(old, 1, 0)))  # two iterations late now: stale
    assert reassembler.stats.stale_dropped == 1
    with pytest.raises(WireError, match="does not match"):
        reassembler.add(ChunkHeader(Kind.MODEL, 1, 2, 0, 1, 16, 2, 16), memoryview(bytes(16)))


def test_a_reassembler_waits_no_more_for_a_refused_chunk_and_keeps_what_refusals_name_bounded():
    layout = TensorLayout.uniform({"all": (0, 12)}, torch.float32)  # 3 chunks of 16 bytes
    reassembler = Reassembler(layout, chunk_bytes=16)
    chunks = list(_chunks_of(torch.arange(12.0), sender=1, iteration=0))
    for header, payload in chunks[:2]:
        reassembler.add(header, payload)
    assert not reassembler.settled(1, 0)
    assert reassembler.refuse(chunks[2][0])  # the last chunk came damaged: nothing more to wait for
    assert reassembler.settled(1, 0) and not reassembler.complete(1, 0) and reassembler.chunks_refused == 1
    got, _ = reassembler.assemble(reassembler.take(0, [1]))
    assert got[1].chunks.present.tolist() == [True, True, False] and reassembler.chunks_lost == 1
    whole = list(_chunks_of(torch.arange(12.0), sender=1, iteration=1))
    assert reassembler.refuse(whole[0][0]) and reassembler.refuse(whole[0][0])  # one mark a chunk
    reassembler.add(*whole[0])  # a whole copy came after all: it is taken, and waited for no more
    assert not reassembler.settled(1, 1) and reassembler.chunks_refused == 2
    assert reassembler.settled(2, 5) is False and reassembler.refuse(ChunkHeader(Kind.MODEL, 2, 5, 0, 3, 16, 2, 48))
    assert not reassembler.refuse(ChunkHeader(Kind.MODEL, 2, 0, 0, 3, 16, 2, 48))  # an iteration taken already
    assert not reassembler.refuse(ChunkHeader(Kind.MODEL, 2, 6, 0, 1, 48, 2, 48))  # another geometry
    for iteration in range(7, 7 + 2 * MAX_PENDING_PER_SENDER):  # a flood of refusals: a few kept per sender
        reassembler.refuse(ChunkHeader(Kind.MODEL, 3, iteration, 0, 3, 16, 2, 48))
    assert sum(sender == 3 for sender, _ in reassembler.refused) == MAX_PENDING_PER_SENDER
    reassembler.take(100, [1, 2, 3])
    assert reassembler.refused == {}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sealed", [False, True])
def test_a_damaged_chunk_is_missing_at_once_not_waited_for(lenet_state, sealed):
    """A sync gather with a long wait: the model's third datagram is damaged on the way (a bit of
    its payload flipped: its checksum, or its seal, fails), and the gather returns once the others
    are in, with that chunk missing, not at its deadline."""
    flat, layout = lenet_state
    wait = UdpSettings(timeout=600.0, chunk_bytes=4000)
    a, b = connected(*(UdpTransport(rank, layout=layout, settings=wait,
                                    seal=DatagramSeal(bytes(range(32))) if sealed else None) for rank in (0, 1)))
    models = []
    send = a.sender._send

    def damaging_the_third(pieces, addr):
        datagram = bytearray(b"".join(bytes(p) for p in pieces))
        if datagram[5] == Kind.MODEL:
            models.append(len(models))
            if len(models) == 3:
                datagram[-1] ^= 1
        send([datagram], addr)

    a.sender._send = damaging_the_third
    try:
        a.broadcast([1], Message(Kind.MODEL, 0, 0, 1, flat.snapshot()))
        got = b.gather(0, [0])[0]
        assert got.chunks.present.logical_not().nonzero().flatten().tolist() == [2]
        assert b.stats.gather_timeouts == 0 and b.stats.malformed_dropped == 1
        assert b.extra_stats()["chunks_refused"] == 1
        chunk = 4000 // 4
        assert torch.equal(got.chunks.vector[:2 * chunk], flat.state[:2 * chunk])
        assert torch.equal(got.chunks.vector[3 * chunk:], flat.state[3 * chunk:])
    finally:
        a.close()
        b.close()


def test_a_sender_paces_to_its_rate_with_the_clock_it_is_given():
    clock, sleeps = FakeClock(), []

    def sleep(seconds):
        sleeps.append(seconds)
        clock.advance(seconds)
    sent = []
    sender = DatagramSender(0, lambda pieces, addr: sent.append(addr), 1000, rate_bytes_per_s=1e6,
                            emulator=Emulator(NetemSpec(), 1), control_emulator=Emulator(NetemSpec(), 2),
                            stats=TransportStats(), clock=clock.monotonic, sleep=sleep)
    payload = torch.zeros(2500)  # 10,000 bytes: 10 chunks per peer
    sender.send_model(Message(Kind.MODEL, 0, 0, 1, {"all": payload}), [("a", 1), ("b", 2)], 10_000)
    assert len(sent) == 20 and sender.datagrams_sent == 20 and sender.stats.messages_sent == 2
    wire_bytes = 20 * (1000 + HEADER_SIZE)
    assert sum(sleeps) == pytest.approx(wire_bytes / 1e6, abs=0.003)  # 1 MB/s: never more than 2 ms ahead


def test_the_handshake_completes_both_ways_and_never_answers_an_answer():
    from meshlearn.transport.udp.handshake import Handshake
    from meshlearn.wire.datagram import FLAG_HEARD, FLAG_REPLY

    a, b = Handshake(), Handshake()  # nodes 0 and 1
    assert a.hello_flags(1) == 0  # a has not heard b yet
    answer = b.on_hello(0, a.hello_flags(1))
    assert answer == FLAG_HEARD | FLAG_REPLY and b.waiting([0], set()) == {0}
    assert a.on_hello(1, answer) is None  # an answer is never answered: no ping-pong
    assert a.waiting([1], set()) == set()  # b said it heard a
    assert a.hello_flags(1) == FLAG_HEARD
    b.on_hello(0, a.hello_flags(1))  # a's next HELLO says it heard b
    assert b.waiting([0], set()) == set() and b.waiting([0, 2], {2}) == set()  # 2 left: not waited for


def test_a_flood_of_new_iterations_from_one_sender_holds_a_few_models_not_one_each():
    """Spoofed datagrams of far iterations used to cost a whole model buffer each."""
    from meshlearn.transport.base import MAX_PENDING_PER_SENDER

    layout = TensorLayout.uniform({"all": (0, 12)}, torch.float32)
    reassembler = Reassembler(layout, chunk_bytes=16)
    first_chunk = next(_chunks_of(torch.zeros(12), 1, 0))[1]
    for iteration in range(100_000, 104_000):
        reassembler.add(ChunkHeader(Kind.MODEL, 1, iteration, 0, 3, 16, 2, 48), first_chunk)
    assert len(reassembler.parts) == MAX_PENDING_PER_SENDER
    assert reassembler.stats.overflow_dropped == 4000 - MAX_PENDING_PER_SENDER
    genuine = torch.arange(12.0)
    for header, payload in _chunks_of(genuine, 1, 0):  # the genuine next model still gets in
        reassembler.add(header, payload)
    got, _ = reassembler.assemble(reassembler.take(0, [1]))
    assert torch.equal(got[1].chunks.vector, genuine)
    for header, payload in _chunks_of(genuine, 2, 0):  # and so does every other sender's
        assert reassembler.add(header, payload)[0] is (header.index == 2)


def test_a_rate_is_written_in_bits_a_second_and_read_back_exactly():
    spec = NetemSpec.parse("delay=200ms,rate=10mbit")
    assert (spec.delay, spec.rate) == (0.2, 10e6) and spec.active
    assert NetemSpec.parse("rate=1.5mbit").describe().endswith("rate=1500kbit")
    for text in ("rate=10mbit", "rate=1.5mbit", "rate=64kbit", "rate=2gbit", "rate=300bit"):
        assert NetemSpec.parse(NetemSpec.parse(text).describe()) == NetemSpec.parse(text)
    assert "rate" not in NetemSpec.parse("delay=1ms").describe()  # no rate: as before
    for bad in ("rate=10", "rate=10mbps", "rate=0mbit", "rate=fast"):
        with pytest.raises(ConfigError, match="must be a bandwidth like 10mbit"):
            NetemSpec.parse(bad)


def test_a_link_sends_what_is_queued_on_it_one_after_another_and_links_do_not_share():
    from meshlearn.netem import LinkRate

    rate = LinkRate(8e6)  # 1 MB a second
    assert rate.through("a", 500_000, now=0.0) == pytest.approx(0.5)
    assert rate.through("a", 500_000, now=0.1) == pytest.approx(1.0)  # behind the first on the same link
    assert rate.through("b", 250_000, now=0.1) == pytest.approx(0.35)  # another link: free
    assert rate.through("a", 1_000, now=3.0) == pytest.approx(3.001)  # an idle link starts at once


def test_a_delay_line_keeps_order_per_key():
    line = DelayLine(keep_order=True)
    assert line.push("a1", 2.0, key="a") == 2.0
    assert line.push("b1", 1.0, key="b") == 1.0  # another connection: not held behind a's
    assert line.push("a2", 1.5, key="a") == 2.0
    assert line.pop_due(1.0) == ["b1"] and line.pop_due(2.0) == ["a1", "a2"]


def test_tcp_emulated_rate_holds_each_message_for_its_time_on_the_link():
    from meshlearn.netem import LinkRate
    clock = FakeClock()
    a, b = _tcp_pair(clock)
    b.link_rate = LinkRate(8e6)  # 1 MB a second, from now on: the handshake is done
    try:
        for iteration in (0, 1):  # two 500 kB models, sent at once
            a.send(1, Message(Kind.MODEL, 0, iteration, 1, {"p": torch.ones(125_000)}))
        deadline = time.monotonic() + 10
        while b.stats.messages_received < 3 and time.monotonic() < deadline:  # HELLO and both models arrive ...
            assert b.recv(0.05) is None  # ... and wait for their time on the link
        clock.advance(0.49)
        assert b.recv(0.05) is None  # 500 kB take 0.5 s at 8 Mbit/s
        clock.advance(0.02)
        assert b.recv(0.05).iteration == 0
        assert b.recv(0.05) is None  # the second came behind it on the same link: through at 1.0 s
        clock.advance(0.5)
        assert b.recv(0.05).iteration == 1
    finally:
        a.close()
        b.close()


def test_udp_emulated_rate_sends_each_links_datagrams_one_after_another():
    clock, sent = FakeClock(), []
    sender = DatagramSender(0, lambda pieces, addr: sent.append(addr), 1000, 1e12,
                            Emulator(NetemSpec(rate=8e6), seed=5), Emulator(NetemSpec(rate=8e6), seed=5),
                            TransportStats(), clock=clock.monotonic, sleep=clock.sleep)
    sender.send_model(Message(Kind.MODEL, 0, 0, 1, {"all": torch.zeros(2500)}), [("a", 1), ("b", 2)], 10_000)
    per_datagram = (1000 + HEADER_SIZE) / 1e6  # seconds on a 1 MB/s link
    assert sent == [] and sender.pending == 20  # 10 datagrams a link, each waiting for its turn
    clock.advance(3.5 * per_datagram)
    sender.release_due()
    assert sent.count(("a", 1)) == 3 and sent.count(("b", 2)) == 3  # the links run side by side
    clock.advance(7 * per_datagram)
    sender.release_due()
    assert len(sent) == 20 and sender.pending == 0
