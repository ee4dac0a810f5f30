"""How long the drop-in adapter's ``update_wait`` blocks per step, fresh fetch vs dpwa's fetch.

Workers are separate processes training an MLP on `digits` with the adapter around every batch,
as a dpwa user's loop does; each reports the mean and median time spent inside ``update_wait``
and its final test accuracy. The two fetch modes alternate, ``--trials`` times each.

    python benchmarks/adapter_wait.py [--workers 2] [--steps 400] [--trials 3] [--step-ms 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import time


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports free right now (held together while chosen, so they differ)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]


def worker(name: str, config: str, steps: int, step_ms: float) -> None:
    import torch
    from torch import nn

    from meshlearn.adapter import GossipAdapter
    from meshlearn.data import load_dataset
    from meshlearn.models import build_model

    data = load_dataset("digits")
    torch.manual_seed(0)
    model = build_model("mlp", data.input_shape, data.num_classes)
    adapter = GossipAdapter(model, name, json.loads(config), seed=int(name[1:]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(int(name[1:]))
    waits, merged, loss = [], 0, None
    for _ in range(steps):
        adapter.update_send(loss)
        batch = torch.randint(0, len(data.train_y), (32,), generator=generator)
        optimizer.zero_grad()
        out = nn.functional.cross_entropy(model(data.train_x[batch]), data.train_y[batch])
        out.backward()
        optimizer.step()
        if step_ms:
            time.sleep(step_ms / 1000)
        loss = out.item()
        t0 = time.perf_counter()
        record = adapter.update_wait(loss)
        waits.append(time.perf_counter() - t0)
        merged += record["fetched"] >= 0 and not record.get("failed")
    with torch.no_grad():
        accuracy = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    adapter.close()
    print(json.dumps({"mean_ms": 1000 * statistics.mean(waits), "median_ms": 1000 * statistics.median(waits),
                      "merged": merged, "accuracy": accuracy}), flush=True)


def run(workers: int, steps: int, fresh: bool, step_ms: float) -> list[dict]:
    ports = _free_ports(workers)
    config = json.dumps({"nodes": [{"name": f"w{i}", "host": "127.0.0.1", "port": p} for i, p in enumerate(ports)],
                         "timeout_ms": 1000, "fetch_probability": 1, "fresh": fresh})
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", f"w{i}", config, str(steps), str(step_ms)],
                              stdout=subprocess.PIPE, text=True) for i in range(workers)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=0.0, help="sleep added to every step (a slower model)")
    args = parser.parse_args()
    rows = {True: [], False: []}
    for trial in range(args.trials):
        for fresh in (False, True):
            results = run(args.workers, args.steps, fresh, args.step_ms)
            rows[fresh].append(results)
            print(f"trial {trial + 1} {'fresh' if fresh else 'dpwa '}: update_wait mean "
                  f"{statistics.mean(r['mean_ms'] for r in results):.2f} ms, median "
                  f"{statistics.mean(r['median_ms'] for r in results):.2f} ms, merged "
                  f"{statistics.mean(r['merged'] for r in results):.0f}/{args.steps}, accuracy "
                  f"{statistics.mean(r['accuracy'] for r in results):.4f}", flush=True)
    for fresh in (False, True):
        means = [statistics.mean(r["mean_ms"] for r in results) for results in rows[fresh]]
        accs = [statistics.mean(r["accuracy"] for r in results) for results in rows[fresh]]
        print(f"{'fresh' if fresh else 'dpwa '}: update_wait mean {statistics.mean(means):.2f} ms per step over "
              f"{args.trials} trials; accuracy {statistics.mean(accs):.4f}")


if __name__ == "__main__":
    main()
