"""Where loss is made: the kernel (a lossy network namespace) or user space, and TCP's loss model."""

import json
import logging
import subprocess

import pytest
from helpers.namespaces import KERNEL

from meshlearn.config import make_config
from meshlearn.errors import ConfigError
from meshlearn.netem import RTO_MIN, Emulator, NetemSpec
from meshlearn.sim import simulate
from meshlearn.sim import kernelnet


def test_retransmit_delay_model():
    assert Emulator(NetemSpec(), 1).retransmit_delay(10**6) == 0.0
    lossy = Emulator(NetemSpec(loss=0.2), 1)
    small = [lossy.retransmit_delay(1000) for _ in range(2000)]
    large = [lossy.retransmit_delay(10**6) for _ in range(2000)]
    # every delay is a sum of doubling timeouts: 0, RTO, 3 RTO, 7 RTO, ...
    assert all(round(d / RTO_MIN + 1) & round(d / RTO_MIN) == 0 for d in small + large)
    # one segment lost twice (0.2^2 = 4%) is rare; among 700 segments it is near certain
    assert sum(d > 0 for d in small) / len(small) == pytest.approx(0.04, abs=0.02)
    assert sum(large) / len(large) > 10 * sum(small) / len(small)
    again = Emulator(NetemSpec(loss=0.2), 1)
    assert [again.retransmit_delay(1000) for _ in range(2000)] == small  # seeded


def test_auto_loss_mode(monkeypatch, caplog):
    udp = make_config({"transport": "udp", "net": "loss=20%"})
    assert kernelnet.resolve_loss_mode(udp).loss_mode == "user"  # exact correlated loss per datagram
    no_loss = make_config({"net": "delay=10ms"})
    assert kernelnet.resolve_loss_mode(no_loss).loss_mode == "user"
    tcp = make_config({"net": "loss=20%"})
    monkeypatch.setattr(kernelnet, "kernel_loss_unavailable", lambda: None)
    assert kernelnet.resolve_loss_mode(tcp).loss_mode == "kernel"
    monkeypatch.setattr(kernelnet, "kernel_loss_unavailable", lambda: "it needs root")
    monkeypatch.delenv(kernelnet.INSIDE, raising=False)
    with caplog.at_level(logging.WARNING):
        assert kernelnet.resolve_loss_mode(tcp).loss_mode == "user"
    assert "it needs root" in caplog.text
    with pytest.raises(ConfigError, match="loss_mode kernel: it needs root"):
        kernelnet.resolve_loss_mode(make_config({"net": "loss=20%", "loss_mode": "kernel"}))


@KERNEL
@pytest.mark.slow  # 25 s; the kernel path's setup and its errors are tested in the default run
def test_kernel_loss_drops_real_packets_and_tcp_still_delivers_everything(tmp_path):
    base = {"nodes": 4, "topology": "ring", "iterations": 12, "test_after": 6, "seed": 5, "rounds": 1}
    clean = simulate(make_config({**base, "output": str(tmp_path / "clean")}), progress=False)
    lossy = simulate(make_config({**base, "net": "loss=10%", "output": str(tmp_path / "lossy")}), progress=False)
    counts = json.loads((lossy.output / "kernel_loss.json").read_text())
    assert counts["packets_on_lo"] > 1000
    assert counts["measured_loss"] == pytest.approx(0.10, abs=0.03)
    assert "loss_mode: kernel" in (lossy.output / "config.yaml").read_text()
    # TCP retransmits: training sees exactly the models it would without loss
    summaries = [json.loads((r.output / "summary.json").read_text())["final"] for r in (clean, lossy)]
    assert summaries[0]["accuracy"] == summaries[1]["accuracy"]
    assert summaries[0]["loss"] == pytest.approx(summaries[1]["loss"], abs=1e-9)
    # the namespace and its rule are gone with the run: none on the host
    assert kernelnet.TABLE not in subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


@KERNEL
def test_kernel_loss_error_in_namespace_is_one_clear_error(tmp_path):
    config = make_config({"nodes": 2, "topology": "ring", "dataset": "mnist:" + str(tmp_path / "absent"),
                          "net": "loss=10%", "loss_mode": "kernel", "output": str(tmp_path / "run")})
    with pytest.raises(Exception) as info:
        simulate(config, progress=False)
    assert "absent" in str(info.value) and "\n" not in str(info.value)
    assert getattr(info.value, "exit_code", None) == 2
