"""Direct paths through real NATs (network namespaces; needs root, ip and nft).

Two providers sit in two homes behind two masquerading routers, a requester in a third; the
"internet" routes between the routers. Their engine links are punched through both NATs (TCP for
a leader task and for D-PSGD over TCP, whose engines then connect between the punched ports
themselves; the UDP engine's own socket for D-PSGD over sealed UDP), so no engine byte crosses
the bootstrap's relay, and a capture of the public side holds no plaintext. Behind a NAT that maps
each destination to a new port (symmetric), the links fall back to the relay, and the task's
metrics say so; behind firewalls that drop every SYN from outside (no TCP punch), over QUIC on a
punched UDP path.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.natlab import NatLab, Sniffer, natlab_available, varied_windows
from helpers.netproc import Processes

pytestmark = pytest.mark.skipif(natlab_available() is not None, reason=str(natlab_available()))
BOOTSTRAP_PORT = 8080
TASK = ("--data", "digits", "--model", "mlp", "--lr", "0.05", "--epochs", "2", "--providers", "2",
        "--host", "0.0.0.0")


def _start(procs: Processes, lab: NatLab, ns: str, name: str, *args: str):
    return procs.start(name, *args, prefix=tuple(lab.command(ns, [])),
                       env={"MESHLEARN_HOME": str(procs.folder / f"home-{name}")})


def _network(procs: Processes, lab: NatLab) -> str:
    """A bootstrap on the public side and a provider in homes 1 and 2; the address peers give."""
    _start(procs, lab, "pub", "bootstrap", "bootstrap", "--host", "0.0.0.0", "--advertise", lab.public_ip,
           "--port", str(BOOTSTRAP_PORT), "--state", str(procs.folder / "registry.sqlite"))
    address = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
    for i in (1, 2):
        _start(procs, lab, f"h{i}", f"home{i}", "provider", "--bootstrap", address, "--host", "0.0.0.0",
               "--id", f"home{i}", "--workdir", str(procs.folder / f"home{i}"))
    for i in (1, 2):
        procs.wait_for(f"home{i}", "registered with", timeout=90)
        assert "peers reach it through the relay" in procs.log(f"home{i}")
    return address


def _request(procs: Processes, lab: NatLab, address: str, name: str, *args: str) -> dict:
    """Run one task from home 3; its metrics."""
    output = procs.folder / name
    requester = _start(procs, lab, "h3", name, "request", "--bootstrap", address, *TASK, *args,
                       "--output", str(output))
    requester.wait(timeout=240)
    assert requester.returncode == 0, procs.log(name)
    return json.loads((output / "metrics.json").read_text())


def _leaks(output, wire: bytes) -> list[str]:
    """Stretches of the training images and of the task's model (in ``output``) found in ``wire``."""
    from safetensors.numpy import load_file

    from meshlearn.data import load_dataset
    from meshlearn.network.task.spec import dataset_spec

    images = load_dataset(dataset_spec("digits")).train_x.numpy().astype(np.float32)
    secrets = [w for image in images[:40] for w in varied_windows(image.tobytes(), 2)]
    model = load_file(str(output / "model.safetensors"))
    secrets += varied_windows(model[min(model)].tobytes(), 8)
    assert len(secrets) > 40
    return [w.hex()[:16] for w in secrets if w in wire]


def _paths(metrics: dict) -> dict[tuple[str, str], dict]:
    """Each engine link of the task (provider, neighbour) -> its path and relay bytes."""
    return {(provider, peer): link for provider, links in metrics["links"].items() for peer, link in links.items()}


def test_providers_behind_two_nats_train_over_punched_paths_the_engines_take_over(procs):
    with NatLab(homes=3, internet=True) as lab:
        address = _network(procs, lab)
        with Sniffer(lab, "pub") as capture:
            # D-PSGD over TCP: its engines connect between the punched ports themselves (the hand-over);
            # the task completes only if that second simultaneous open gets through both NATs too
            tcp = _request(procs, lab, address, "tcp", "--algorithm", "dpsgd", "--transport", "tcp")
        assert tcp["algorithm"] == "dpsgd" and tcp["lost"] == [] and tcp["accuracy"] > 0.5, tcp
        assert set(_paths(tcp)) == {("home1", "home2"), ("home2", "home1")}, tcp["links"]
        assert all(link == {"path": "punched", "relay_bytes": 0} for link in _paths(tcp).values()), tcp["links"]
        assert "links: home2 punched" in procs.log("home1"), procs.log("home1")
        assert not _leaks(procs.folder / "tcp", capture.data())


@pytest.mark.slow  # 35 s; its quick sibling is the D-PSGD task above, over the same punched paths
def test_providers_behind_two_nats_train_the_leader_and_udp_over_punched_paths_with_no_byte_through_the_relay(procs):
    with NatLab(homes=3, internet=True) as lab:
        address = _network(procs, lab)
        with Sniffer(lab, "pub") as capture:
            leader = _request(procs, lab, address, "leader", "--algorithm", "leader")
        assert leader["accuracy"] > 0.7, leader
        links = _paths(leader)
        assert set(links) == {("home1", "home2"), ("home2", "home1")}, leader["links"]
        assert all(link == {"path": "punched", "relay_bytes": 0} for link in links.values()), links
        assert not _leaks(procs.folder / "leader", capture.data())

        udp = _request(procs, lab, address, "udp", "--algorithm", "dpsgd", "--transport", "udp",
                       "--aggregate-every", "5")
        assert udp["algorithm"] == "dpsgd" and udp["lost"] == [] and udp["accuracy"] > 0.5, udp
        assert all(link == {"path": "punched", "relay_bytes": 0} for link in _paths(udp).values()), udp["links"]


def test_behind_a_symmetric_nat_the_links_fall_back_to_the_relay_and_the_metrics_say_so(procs):
    """Also the quick sibling of test_network_nat's slow test: a task through the relay, the requester
    at home serving its data through it too, and only ciphertext on the public side."""
    with NatLab(homes=3, internet=True, symmetric=(2,)) as lab:
        address = _network(procs, lab)
        with Sniffer(lab, "pub") as capture:
            leader = _request(procs, lab, address, "leader", "--algorithm", "leader")
        assert leader["accuracy"] > 0.7, leader
        assert "providers fetch the data through the relay" in procs.log("leader")
        assert not _leaks(procs.folder / "leader", capture.data())
        links = _paths(leader)
        assert {link["path"] for link in links.values()} == {"relayed"}, links
        assert sum(link["relay_bytes"] for link in links.values()) > 0, links  # (a leader's own link may stay idle)
        out = procs.log("home2")
        assert "maps each destination to a new port" in out, out


# slow (30 s): its quick sibling is test_punch's pair linked over QUIC on loopback
@pytest.mark.slow
def test_behind_firewalls_that_drop_every_syn_from_outside_the_links_go_over_quic_on_punched_udp(procs):
    with NatLab(homes=3, internet=True, syn_blocked=(1, 2)) as lab:
        address = _network(procs, lab)
        leader = _request(procs, lab, address, "leader", "--algorithm", "leader")
        assert leader["accuracy"] > 0.7, leader
        assert all(link == {"path": "quic", "relay_bytes": 0} for link in _paths(leader).values()), leader["links"]
