"""How long a gossip run's last node finishes after its first: the cost of shutting down.

Nodes of a gossip run finish at nearly the same moment; a fetch sent to a peer that is just
closing must not cost the asker its whole ``fetch_timeout``.

    python benchmarks/gossip_shutdown.py [--seeds 1 2 3 4 5 6] [--iterations 20] [--fetch-timeout 2.5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from meshlearn.config import make_config
from meshlearn.sim import simulate
from meshlearn.sim.tables import load_logs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--nodes", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--fetch-timeout", type=float, default=2.5)
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="gossip-shutdown-"))
    spreads = []
    for seed in args.seeds:
        config = make_config({"nodes": args.nodes, "topology": "regular:3", "dataset": "digits", "model": "mlp",
                              "algorithm": "gossip", "rounds": 5, "iterations": args.iterations, "test_after": 5,
                              "fetch_timeout": args.fetch_timeout, "lr": 0.8, "seed": seed, "slowdown": "*:+20ms",
                              "output": str(out / f"seed{seed}")})
        result = simulate(config, progress=False)
        ends = [[e for e in events if e.get("event") == "iteration"][-1]["t"] for events in load_logs(result.output).values()]
        spreads.append(max(ends) - min(ends))
        print(f"seed {seed}: last node done {spreads[-1]:.2f} s after the first", flush=True)
    late = sum(spread > args.fetch_timeout / 2 for spread in spreads)
    print(f"mean {statistics.fmean(spreads):.2f} s; {late} of {len(spreads)} runs ended a fetch timeout late")


if __name__ == "__main__":
    main()
