"""A UDP task's pacing: the rate a requester asks (``request --udp-rate``) reaches every provider's
UDP engine, a stranger's absurd rate is refused, a sender that stalls sends no burst, and across an
emulated 10 Mbit/s uplink (a NAT lab, tc tbf) a paced message loses almost nothing where an unpaced
one loses most of its chunks (benchmarks/udp_pacing.py, at a short size)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from helpers.natlab import NatLab, natlab_available

from meshlearn.clock import FakeClock
from meshlearn.errors import BadMessage, ConfigError
from meshlearn.flat import FlatState
from meshlearn.models import build_model
from meshlearn.netem import Emulator, NetemSpec
from meshlearn.network.task.spec import UDP_RATE, TaskRequest, TaskSettings, TaskSpec
from meshlearn.node.factory import make_transport
from meshlearn.transport.base import TransportStats
from meshlearn.transport.settings import UdpSettings
from meshlearn.transport.udp.sender import CATCH_UP, PACE_SLACK, DatagramSender
from meshlearn.wire import Kind, Message
from meshlearn.wire.datagram import HEADER_SIZE
from meshlearn.wire.sealed import FrameSeal

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "udp_pacing.py"
PEERS = [{"id": "p0", "address": "127.0.0.1:1"}, {"id": "p1", "address": "127.0.0.1:2"}]
PACED_LOSS = 0.05  # the most of a paced message's chunks its own bursts may cost it (at the link's rate)


def _spec(request: TaskRequest) -> TaskSpec:
    """The spec a provider gets for ``request``, as the requester builds it and the wire carries it."""
    spec = TaskSpec(**request.fields_of(TaskSettings), task_id="t1", peers=PEERS, data={"mode": "local"})
    return TaskSpec.parse(spec.model_dump(mode="json"))


def test_the_asked_rate_reaches_the_provider_engines_udp_sender():
    request = TaskRequest(data="digits", model="mlp", algorithm="dpsgd", transport="udp", udp_rate="20mbit")
    spec = _spec(request)
    config = spec.experiment_config(samples=100, host="127.0.0.1", device="cpu", max_message_mb=32)
    assert spec.udp_rate == 20.0 and config.udp.rate_gbps == pytest.approx(0.02)
    flat = FlatState(build_model("mlp", (1, 8, 8), 10))
    transport = make_transport(config, 0, flat, seal=FrameSeal(bytes(32)))
    assert transport.sender.rate == pytest.approx(20e6 / 8)  # bytes a second
    default = _spec(TaskRequest(data="digits", algorithm="dpsgd", transport="udp"))
    assert default.udp_rate == UDP_RATE and default.experiment_config(100, "127.0.0.1", "cpu", 32).udp.rate_gbps \
        == pytest.approx(UDP_RATE / 1000)
    assert UdpSettings().rate_gbps == 16.0  # simulations on one machine keep their own rate


@pytest.mark.parametrize("given, mbit", [("9.5mbit", 9.5), ("1gbit", 1000.0), ("800kbit", None), ("75", 75.0),
                                         (" 2 GBIT ", 2000.0), ("20gbit", None), ("fast", None), ("nan", None)])
def test_a_rate_is_read_in_tc_units_or_mbit_and_one_outside_the_range_is_one_line(given, mbit):
    if mbit is not None:
        assert TaskRequest(data="digits", udp_rate=given).udp_rate == mbit
        return
    with pytest.raises(ConfigError) as caught:
        TaskRequest(data="digits", udp_rate=given)
    said = str(caught.value)
    assert said.startswith("udp_rate ") and ("is not a rate" in said or "a task may ask" in said), said
    assert "\n" not in said


def test_a_strangers_spec_with_an_absurd_rate_is_refused_by_the_provider():
    spec = _spec(TaskRequest(data="digits", algorithm="dpsgd", transport="udp")).model_dump(mode="json")
    for rate in (1e9, 0.001, "1tbit"):
        with pytest.raises(BadMessage, match=r"^task spec: udp_rate .*(a task may ask|is not a rate)"):
            TaskSpec.parse({**spec, "udp_rate": rate})


def test_the_rate_is_not_part_of_what_a_resumed_task_must_train_as():
    slow = _spec(TaskRequest(data="digits", algorithm="dpsgd", transport="udp", udp_rate="5mbit"))
    assert slow.fingerprint() == _spec(TaskRequest(data="digits", algorithm="dpsgd", transport="udp")).fingerprint()


def test_request_reads_udp_rate_once_and_says_a_bad_one_in_one_line(capsys):
    from meshlearn.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(["request", "--bootstrap", "127.0.0.1:9", "--data", "digits", "--udp-rate", "10mbps"])
    said = capsys.readouterr().err.strip()
    assert exited.value.code == 2 and len(said.splitlines()) == 1, said
    assert "argument --udp-rate: '10mbps' is not a rate: give one like 50mbit" in said


def test_a_sender_that_stalls_catches_up_without_a_burst():
    """The clock jumps 50 ms (the sender descheduled) at its 5th datagram: at 1 MB/s it is then 50 KB
    behind, and sends only CATCH_UP's worth at once before it paces again."""
    clock, times = FakeClock(), []

    def send(pieces, addr):
        times.append(clock.monotonic())
        if len(times) == 5:
            clock.advance(0.05)
    sender = DatagramSender(0, send, 1000, rate_bytes_per_s=1e6, emulator=Emulator(NetemSpec(), 1),
                            control_emulator=Emulator(NetemSpec(), 2), stats=TransportStats(),
                            clock=clock.monotonic, sleep=clock.advance)
    sender.send_model(Message(Kind.MODEL, 0, 0, 1, {"all": torch.zeros(25_000)}), [("a", 1)], 100_000)
    assert len(times) == 100
    burst = max(times.count(t) for t in set(times[5:]))  # datagrams handed on at one instant
    assert burst <= (CATCH_UP + PACE_SLACK) * 1e6 / (1000 + HEADER_SIZE) + 1, burst
    paced = times[-1] - times[5]  # the rest of the message, after the stall, at 1 MB/s
    assert paced == pytest.approx(94 * (1000 + HEADER_SIZE) / 1e6, abs=CATCH_UP + PACE_SLACK)


def _benchmark():
    spec = importlib.util.spec_from_file_location("udp_pacing", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NO_LAB = natlab_available() or (None if shutil.which("tc") else "shaping a link needs `tc` (iproute2)")


@pytest.mark.skipif(NO_LAB is not None, reason=str(NO_LAB))
def test_paced_at_a_10mbit_uplinks_rate_a_message_loses_almost_nothing_and_unpaced_most():
    bench = _benchmark()
    with NatLab(homes=1, internet=True) as lab:
        bench.shape_uplink(lab, "10mbit", "32kb", "50ms")  # a home router's small queue
        paced = bench.one_message(lab, rate_gbps=0.0095, mb=1.5, seed=1)
        unpaced = bench.one_message(lab, rate_gbps=UdpSettings().rate_gbps, mb=1.5, seed=2)
    assert paced["chunks"] == unpaced["chunks"] > 1000
    assert paced["loss"] <= PACED_LOSS, (paced, unpaced)
    assert unpaced["loss"] >= 0.5, (paced, unpaced)  # its burst overflows the queue: far beyond any pacing slip
