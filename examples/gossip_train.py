"""A plain PyTorch training loop with gossip averaging: the only meshlearn calls are the adapter's.

Start one worker per name in the config; `gossip_cluster.py` starts them all on this machine and
stops them all on Ctrl-C:

    python examples/gossip_cluster.py --config examples/gossip-4.yaml

or one by one, e.g. on different machines: `python examples/gossip_train.py --config gossip.yaml --name w1`.
The config is dpwa's format, unchanged. Data: `digits` by default (shipped with scikit-learn: four
workers reach about 90% in 10 epochs, 15 s on a 2-core CPU); CIFAR-10 with
`--dataset cifar10:PATH --model lenet --lr 0.01`. SIGTERM, like Ctrl-C, closes the endpoint on the way out.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import numpy as np
import torch
from torch import nn

from meshlearn.adapter import GossipAdapter, load_gossip_config
from meshlearn.data import load_dataset, partition
from meshlearn.errors import MeshlearnError
from meshlearn.models import build_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="dpwa or meshlearn gossip YAML")
    parser.add_argument("--name", required=True, help="this worker's name in the config")
    parser.add_argument("--dataset", default="digits", help="dataset spec, as meshlearn simulate's (default: digits)")
    parser.add_argument("--model", default="mlp", help="registered model name (default: mlp)")
    parser.add_argument("--epochs", type=int, default=10, help="passes over this worker's share (default: 10)")
    parser.add_argument("--batch-size", type=int, default=16, help="mini-batch size (default: 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the partition and initial models (default: 1)")
    parser.add_argument("--result", help="write final accuracy (JSON) here, and parameters to RESULT.npy")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: the adapter closes

    torch.set_num_threads(1)
    workers = [node.name for node in load_gossip_config(args.config).nodes]
    if args.name not in workers:
        raise MeshlearnError(f"--name {args.name} is not in {args.config}: use one of {', '.join(workers)}")
    rank = workers.index(args.name)
    data = load_dataset(args.dataset)
    mine = torch.as_tensor(partition(data.train_y.numpy(), len(workers), "iid", args.seed)[rank])
    torch.manual_seed(args.seed * 100 + rank)  # each worker starts from its own random model
    model = build_model(args.model, data.input_shape, data.num_classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()

    with GossipAdapter(model, args.name, args.config) as adapter:  # <- meshlearn
        loss = None
        for epoch in range(args.epochs):
            order = mine[torch.randperm(len(mine))]
            for start in range(0, len(order), args.batch_size):
                batch = order[start:start + args.batch_size]
                adapter.update_send(loss)  # <- meshlearn: maybe start fetching a peer
                model.train()
                optimizer.zero_grad()
                step_loss = loss_fn(model(data.normalize(data.train_x[batch])), data.train_y[batch])
                step_loss.backward()
                optimizer.step()
                loss = step_loss.item()
                adapter.update_wait(loss)  # <- meshlearn: publish, wait for the fetch, interpolate
            print(f"{args.name}: epoch {epoch + 1} loss {loss:.3f} clock {adapter.clock:.0f}", flush=True)
        scores = adapter.scores

    model.eval()
    with torch.no_grad():
        accuracy = (model(data.normalize(data.test_x)).argmax(1) == data.test_y).float().mean().item()
    print(f"{args.name}: test accuracy {accuracy:.4f}", flush=True)
    if args.result:
        final = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        np.save(args.result + ".npy", np.stack([initial, final]))
        with open(args.result, "w") as handle:
            json.dump({"name": args.name, "accuracy": accuracy, "scores": scores}, handle)


if __name__ == "__main__":
    try:
        main()
    except MeshlearnError as exc:  # a bad config, name or dataset: one line, not a traceback
        sys.exit(f"error: {exc}")
