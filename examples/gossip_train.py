"""A plain PyTorch training loop with gossip averaging: the only meshlearn calls are the adapter's.

Start one worker per name in the config; `gossip_cluster.py` starts them all on this machine and
stops them all on Ctrl-C:

    python examples/gossip_cluster.py --config examples/gossip-4.yaml

or one by one, e.g. on different machines: `python examples/gossip_train.py --config gossip.yaml --name w1`.
The config is dpwa's format, unchanged. Data: `digits` by default (shipped with scikit-learn: four
workers reach about 90% in 10 epochs, 15 s on a 2-core CPU); CIFAR-10 with
`--dataset cifar10:PATH --model lenet --lr 0.01`; a language model with
`--dataset pystdlib --model gpt-tiny --context 64 --optimizer adamw --lr 0.003 --steps 200` (the
loss and metrics are the dataset's task's: next-token cross-entropy, perplexity). SIGTERM, like
Ctrl-C, closes the endpoint on the way out.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import numpy as np
import torch

from meshlearn.adapter import GossipAdapter, load_gossip_config
from meshlearn.data import load_dataset, partition_dataset
from meshlearn.errors import MeshlearnError
from meshlearn.evaluation import evaluate_model
from meshlearn.models import build_model
from meshlearn.tasks import task_of

CLUSTER = "python3 examples/gossip_cluster.py --config examples/gossip-4.yaml"  # every worker, this machine


def parser() -> argparse.ArgumentParser:
    """This script's command line."""
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"To start every worker of a config on this machine: {CLUSTER} [these flags]")
    parser.add_argument("--config", help="dpwa or meshlearn gossip YAML (required)")
    parser.add_argument("--name", help="this worker's name in the config (required)")
    parser.add_argument("--dataset", default="digits", help="dataset spec, as meshlearn simulate's (default: digits)")
    parser.add_argument("--model", default="mlp", help="registered model name (default: mlp)")
    parser.add_argument("--epochs", type=int, default=10, help="passes over this worker's share (default: 10)")
    parser.add_argument("--batch-size", type=int, default=16, help="mini-batch size (default: 16)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd", help="torch optimizer (default: sgd)")
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps (default: 0, the epochs')")
    parser.add_argument("--context", type=int, default=128, help="text data: tokens a window (default: 128)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the partition and initial models (default: 1)")
    parser.add_argument("--result", help="write final metrics (JSON) here, and parameters to RESULT.npy")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line ``argv`` (default: sys.argv) as flags; exit 2 with one line saying what to
    run instead when --config or --name is missing (the README's test parses its commands with it)."""
    command = parser()
    args = command.parse_args(argv)
    missing = [flag for flag, value in (("--config", args.config), ("--name", args.name)) if not value]
    if missing:
        command.error(f"{' and '.join(missing)} required: this script is one worker of a gossip config; "
                      f"to start them all on this machine, run {CLUSTER} with the same flags")
    return args


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwind: the adapter closes

    torch.set_num_threads(1)
    workers = [node.name for node in load_gossip_config(args.config).nodes]
    if args.name not in workers:
        raise MeshlearnError(f"--name {args.name} is not in {args.config}: use one of {', '.join(workers)}")
    rank = workers.index(args.name)
    data = load_dataset(args.dataset, context=args.context)
    mine = torch.as_tensor(partition_dataset(data, len(workers), "iid", args.seed)[rank])
    torch.manual_seed(args.seed * 100 + rank)  # each worker starts from its own random model
    model = build_model(args.model, data.input_shape, data.num_classes)
    optimizer = (torch.optim.AdamW if args.optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=args.lr)
    loss_fn = task_of(data).loss  # cross-entropy over classes, or over the next token at every position
    initial = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()

    with GossipAdapter(model, args.name, args.config) as adapter:  # <- meshlearn
        loss, steps = None, 0
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
                steps += 1
                if steps == args.steps:
                    break
            print(f"{args.name}: epoch {epoch + 1} loss {loss:.3f} clock {adapter.clock:.0f}", flush=True)
            if steps == args.steps:
                break
        scores = adapter.scores

    metrics = evaluate_model(model, data, limit=2048).as_dict()  # at most 2,048 test samples (windows)
    accuracy = metrics["accuracy"]
    print(f"{args.name}: test accuracy {accuracy:.4f}" + (f", perplexity {metrics['perplexity']:.2f}"
                                                          if "perplexity" in metrics else ""), flush=True)
    if args.result:
        final = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        np.save(args.result + ".npy", np.stack([initial, final]))
        with open(args.result, "w") as handle:
            json.dump({"name": args.name, **metrics, "scores": scores}, handle)


if __name__ == "__main__":
    try:
        main()
    except MeshlearnError as exc:  # a bad config, name or dataset: one line, not a traceback
        sys.exit(f"error: {exc}")
