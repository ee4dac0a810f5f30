"""The network across NAT, on a real NAT built with network namespaces (needs root, ip and nft).

A "public" namespace runs the bootstrap and its relay; two providers and the requester each sit in
a home of their own behind a masquerading router, which lets nothing in. Nothing can dial them, so
every byte between them crosses the relay in the public namespace, where a capture checks that
it is all ciphertext.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers.natlab import NatLab, Sniffer, natlab_available, varied_windows
from helpers.netproc import Processes

pytestmark = pytest.mark.skipif(natlab_available() is not None, reason=str(natlab_available()))

@pytest.fixture
def lab():
    with NatLab(homes=3) as built:
        yield built


def _start(procs: Processes, lab: NatLab, ns: str, name: str, *args: str):
    return procs.start(name, *args, prefix=tuple(lab.command(ns, [])),
                       env={"MESHLEARN_HOME": str(procs.folder / f"home-{name}")})


# slow: its quick sibling is test_nat_punch's task behind a symmetric NAT (through the relay, the
# requester at home, a capture of the public side)
@pytest.mark.slow
def test_providers_and_a_requester_behind_nat_train_through_the_relay_and_only_ciphertext_crosses_it(lab, procs):
    bootstrap_port = 8080
    _start(procs, lab, "pub", "bootstrap", "bootstrap", "--host", "0.0.0.0", "--advertise", lab.public_ip,
           "--port", str(bootstrap_port), "--state", str(procs.folder / "registry.sqlite"))
    address = procs.wait_for("bootstrap", r"other machines give --bootstrap (\S+)").group(1)
    assert address.startswith(f"{lab.public_ip}:{bootstrap_port}@")
    for i in (1, 2):
        _start(procs, lab, f"h{i}", f"home{i}", "provider", "--bootstrap", address, "--host", "0.0.0.0",
               "--id", f"home{i}", "--workdir", str(procs.folder / f"home{i}"))
    ports = {}
    for i in (1, 2):
        procs.wait_for(f"home{i}", "registered with", timeout=90)
        log = procs.log(f"home{i}")
        assert "peers reach it through the relay" in log, log
        ports[i] = int(procs.wait_for(f"home{i}", r"listening on 0\.0\.0\.0:(\d+)").group(1))

    # nothing on the public side can open a connection to a provider at home
    for i in (1, 2):
        with lab.socket("pub") as probe:
            probe.settimeout(2)
            with pytest.raises(OSError):
                probe.connect((lab.home_ip(i), ports[i]))

    from meshlearn.data import load_dataset
    from meshlearn.network.task.spec import dataset_spec

    images = load_dataset(dataset_spec("digits")).train_x.numpy().astype(np.float32)
    secrets = [w for image in images[:40] for w in varied_windows(image.tobytes(), 2)]
    assert len(secrets) > 40
    output = procs.folder / "result"
    with Sniffer(lab, "pub") as capture:
        requester = _start(procs, lab, "h3", "requester", "request", "--bootstrap", address, "--data", "digits",
                           "--model", "mlp", "--lr", "0.05", "--algorithm", "leader", "--epochs", "2",
                           "--providers", "2",
                           "--host", "0.0.0.0", "--output", str(output))
        requester.wait(timeout=240)
    log = procs.log("requester")
    assert requester.returncode == 0, log
    assert "providers fetch the data through the relay" in log
    metrics = json.loads((output / "metrics.json").read_text())
    assert metrics["accuracy"] > 0.7, metrics

    from safetensors.numpy import load_file

    model = load_file(str(output / "model.safetensors"))
    first = model[min(model)]
    secrets += varied_windows(first.tobytes(), 8)
    wire = capture.data()
    # the data (1797 images of 256 bytes, twice: to the relay and on to the provider) and the
    # models crossed this namespace: the capture holds at least that much
    assert len(wire) > 2 * images[: int(len(images) * 0.5)].nbytes, len(wire)
    leaked = [w.hex()[:16] for w in secrets if w in wire]
    assert not leaked, f"plaintext on the wire: {leaked}"


def test_the_capture_would_see_plaintext(lab):
    """The check above can fail: bytes sent in the clear through the public namespace are found."""
    payload = np.random.default_rng(0).standard_normal(64).astype(np.float32).tobytes()
    server = lab.socket("pub")
    server.bind((lab.public_ip, 0))
    server.listen(1)
    with Sniffer(lab, "pub") as capture, server, lab.socket("h1") as client:
        client.connect(server.getsockname())
        client.sendall(payload)
        conn, _ = server.accept()
        with conn:
            received = b""
            while len(received) < len(payload):
                received += conn.recv(4096)
    assert varied_windows(payload, 1)[0] in capture.data()
