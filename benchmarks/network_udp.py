"""A network task over TCP and over sealed UDP, side by side, on slow lossy links between providers.

A bootstrap and ``--providers`` providers on loopback, each provider started with
``MESHLEARN_TEST_NET`` (the emulated network on its task engines' links, ``--net``'s syntax; the
control channel is not emulated), then the same D-PSGD task requested once per transport
(``meshlearn request --transport T``), alternating for ``--repeats``. It prints each task's
training seconds (the same iterations in each), the UDP / TCP ratio, and the accuracies.

Over TCP, loss is modelled as the retransmission delays it would cost (``netem.retransmit_delays``:
a lower bound; this machine has no netem qdisc), delay and jitter per message; over UDP, datagrams
are lost and delayed one by one and a provider averages what came within ``--udp-timeout``.

    python3 benchmarks/network_udp.py [--net loss=20%,corr=25%,delay=200ms,jitter=50ms] [--providers 3]
        [--epochs 3] [--udp-timeout 0.4] [--model mlp] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers.netproc import Processes, start_network  # noqa: E402  (the tests' own way to start a network)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--net", default="loss=20%,corr=25%,delay=200ms,jitter=50ms")
    parser.add_argument("--providers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--udp-timeout", type=float, default=0.4)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="network-udp-"))
    os.environ["MESHLEARN_HOME"] = str(folder / "home")  # keys and pinned bootstraps of this benchmark only
    os.environ["MESHLEARN_TEST_NET"] = args.net  # every provider's engine links (the others ignore it)
    services = Processes(folder)
    try:
        bootstrap, _ = start_network(services, args.providers)
        print(f"{args.providers} providers, links: {args.net}; D-PSGD, {args.model} on digits, {args.epochs} epochs")
        seconds: dict[str, list[float]] = {"tcp": [], "udp": []}
        for repeat in range(args.repeats):
            for transport in ("tcp", "udp"):
                name = f"{transport}-{repeat + 1}"
                proc = services.start(name, "request", "--bootstrap", bootstrap, "--data", "digits", "--model",
                                      args.model, "--lr", "0.05", "--batch-size", "16", "--algorithm", "dpsgd",
                                      "--transport", transport, "--udp-timeout", str(args.udp_timeout),
                                      "--epochs", str(args.epochs), "--providers", str(args.providers),
                                      "--aggregate-every", "5", "--wait", "30", "--output", str(folder / name))
                if proc.wait(timeout=3600) != 0:
                    raise RuntimeError(f"the {transport} task failed: see {folder / name}.log")
                metrics = json.loads((folder / name / "metrics.json").read_text())
                seconds[transport].append(metrics["training_time"])
                print(f"{name}: training {metrics['training_time']:.1f} s, accuracy {metrics['accuracy']:.4f}, "
                      f"lost {metrics['lost']}", flush=True)
        tcp, udp = (sum(values) / len(values) for values in (seconds["tcp"], seconds["udp"]))
        print(f"UDP / TCP training seconds: {udp / tcp:.3f} (means {udp:.1f} / {tcp:.1f} s); logs in {folder}")
    finally:
        services.stop_all()


if __name__ == "__main__":
    main()
