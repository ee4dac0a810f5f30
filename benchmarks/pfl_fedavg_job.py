"""The pfl-research side of `fedavg_vs_pfl.py`: one FedAvg job in Apple's pfl (0.6.0), PyTorch backend.

Run by `fedavg_vs_pfl.py` with the python of its pfl virtual environment, never imported by meshlearn:

    python pfl_fedavg_job.py JOBDIR [--threads N] [--processes P]

JOBDIR (written by the driver) holds `split.npz` (each central iteration's cohort, `cohorts`, and
the samples each drawn client trains on in that iteration, batch by batch: `picks`, `sizes`),
`init.pt` (the initial weights) and `job.json` (hyperparameters, the normalization and the folder of
Fashion-MNIST's IDX files, which this job decodes itself, as meshlearn's run does).

The data order is meshlearn's: a client does not restart its shard each time it is drawn (pfl's
`Dataset` would hand it the same first batches every time) but takes the next batches of its own
endless, per-epoch reshuffled stream (`ShardLoaders` in meshlearn, drawn by the driver), so both
systems compute the same steps on the same samples. Each drawn client's `Dataset` yields exactly
those batches and counts its whole shard as its data points (FedAvg's weight, as meshlearn's).

`--threads N`: torch's intra-op threads (and OMP_NUM_THREADS) of each process. `--processes P`:
pfl's own distributed simulation ("Fast distributed simulations" in pfl's guide: one process per
worker, `PFL_WORKER_ADDRESSES` / `PFL_WORKER_RANK`, the cohort's users split among them, their
statistics summed with torch.distributed over gloo on this machine); this process is rank 0 and
starts the others, and waits for them, so that their CPU time is counted with its own.

The job imports neither meshlearn nor the driver: pfl, torch and numpy only. Rank 0 prints one JSON
line, the central model's loss and accuracy on the 10,000 test images after the last iteration.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

RANK = "PFL_WORKER_RANK"
ADDRESSES = "PFL_WORKER_ADDRESSES"


def parse() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--processes", type=int, default=1, help="pfl worker processes (distributed simulation)")
    return parser.parse_args()


def start_workers(args: argparse.Namespace) -> list[subprocess.Popen]:
    """Before pfl is imported (it reads its distributed settings then): with ``--processes`` P > 1
    and no rank given, make this process rank 0 of P and start ranks 1..P-1 (the same command)."""
    if args.processes <= 1 or RANK in os.environ:
        return []
    with socket.socket() as probe:  # a free port for rank 0's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    os.environ[ADDRESSES] = ",".join(f"127.0.0.1:{port + k}" for k in range(args.processes))
    os.environ[RANK] = "0"
    return [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, RANK: str(k)})
            for k in range(1, args.processes)]


def idx(path: Path):
    """An IDX file (gzipped or not) as a numpy array."""
    import numpy as np

    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * k: 8 + 4 * k], "big") for k in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(folder: Path, name: str):
    """Fashion-MNIST's ``name`` IDX file from ``folder`` (gzipped or not)."""
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return idx(candidate)
    raise SystemExit(f"no {name}(.gz) in {folder}")


def main(args: argparse.Namespace) -> None:
    """Build the federated dataset, model and algorithm, run FedAvg, print the test metrics."""
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    workers = start_workers(args)

    import dataclasses
    import types

    import numpy as np
    import torch
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.pytorch import PyTorchTensorDataset
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import StringMetricName, Weighted
    from pfl.model.pytorch import PyTorchModel
    from torch import nn
    from torch.nn import functional as F

    torch.set_num_threads(args.threads)

    class MLP(nn.Module):
        """meshlearn's `mlp` on 28x28 inputs, layer for layer (so its state dict loads as it is)."""

        def __init__(self, inputs: int, classes: int):
            super().__init__()
            self.net = nn.Sequential(nn.Flatten(), nn.Linear(inputs, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(),
                                     nn.Linear(64, classes))

        def forward(self, x):
            return self.net(x)

    def loss(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = False) -> torch.Tensor:
        """pfl's PyTorch loss hook (as in pfl's benchmarks/model/pytorch/metrics.py): mean cross-entropy."""
        self.eval() if eval else self.train()
        return F.cross_entropy(self(inputs), targets.long())

    @torch.no_grad()
    def metrics(self: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, eval: bool = True) -> dict:
        """pfl's PyTorch metrics hook: summed loss and correct predictions, weighted by samples."""
        self.eval() if eval else self.train()
        logits = self(inputs)
        correct = float((logits.argmax(-1) == targets.long()).sum())
        return {"loss": Weighted(float(F.cross_entropy(logits, targets.long(), reduction="sum")), len(inputs)),
                "accuracy": Weighted(correct, len(inputs))}

    class FedAvgNoLocalEval(FederatedAveraging):
        """pfl's FederatedAveraging without the per-user evaluation (before and after local training)
        that pfl does in every central iteration whose number is a multiple of `evaluation_frequency`,
        which always includes iteration 0. meshlearn's FedAvg does no such thing; both evaluate the
        central model on the test set once, at the end."""

        def get_next_central_contexts(self, *a, **kw):
            """The contexts of FederatedAveraging, with `do_evaluation` off."""
            contexts, model, extra = super().get_next_central_contexts(*a, **kw)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, extra

    class StreamDataset(PyTorchTensorDataset):
        """One drawn client's data for one central iteration: the batches of its stream (their
        samples in order, ``sizes`` long each), yielded as they are whatever the batch size asked
        (the driver drew them with the job's batch size); its length is the client's shard size,
        the data points FedAvg weighs it by (meshlearn: the shard's samples)."""

        def __init__(self, tensors, sizes: list[int], shard: int, user_id: str):
            super().__init__(tensors, user_id=user_id)
            self.sizes, self.shard = sizes, shard

        def __len__(self):
            return self.shard

        def iter(self, batch_size):
            start = 0
            for size in self.sizes:
                yield tuple(t[start:start + size] for t in self.raw_data)
                start += size

    job = json.loads((args.folder / "job.json").read_text())
    torch.manual_seed(job["seed"])
    np.random.seed(job["seed"])
    split = np.load(args.folder / "split.npz")
    data = Path(job["data"])
    train_x, train_y = load(data, "train-images-idx3-ubyte"), load(data, "train-labels-idx1-ubyte").astype(np.int64)
    cohorts, sizes, picks, shards = split["cohorts"], split["sizes"], split["picks"], split["shards"]
    offsets = np.concatenate([[0], np.cumsum(sizes.reshape(-1, sizes.shape[-1]).sum(axis=1))])
    mean, std = job["mean"], job["std"]

    def normalized(x: np.ndarray) -> torch.Tensor:
        """uint8 images to float32, scaled and normalized as meshlearn does."""
        return (torch.from_numpy(np.asarray(x, dtype=np.float32)) / 255.0 - mean) / std

    def positions():
        """pfl's `user_sampler` (a callable giving the next user): the position of the next draw in
        the cohorts laid end to end (iteration t's j-th client is t * cohort + j), so that the
        dataset built for it is that client's batches of that iteration, on every rank."""
        order = iter(range(cohorts.size))
        return lambda: next(order)

    def make_dataset(position: int) -> StreamDataset:
        """The drawn client's batches of this iteration (pfl's `make_dataset_fn`)."""
        client = int(cohorts.reshape(-1)[position])
        index = picks[offsets[position]:offsets[position + 1]]
        return StreamDataset((normalized(train_x[index]), torch.from_numpy(train_y[index])),
                             sizes.reshape(-1, sizes.shape[-1])[position].tolist(), int(shards[client]), str(client))

    training = FederatedDataset(make_dataset, positions())
    module = MLP(int(np.prod(train_x.shape[1:])), 10)
    module.load_state_dict(torch.load(args.folder / "init.pt", weights_only=True))
    module.loss = types.MethodType(loss, module)
    module.metrics = types.MethodType(metrics, module)
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(params, job["server_lr"]))
    backend = SimulatedBackend(training_data=training, val_data=None, postprocessors=[WeightByDatapoints()])
    train_params = NNTrainHyperParams(local_learning_rate=job["lr"], local_batch_size=job["batch_size"],
                                      local_num_steps=job["steps"], local_num_epochs=None)
    algorithm_params = NNAlgorithmParams(central_num_iterations=job["iterations"],
                                         evaluation_frequency=job["iterations"],
                                         train_cohort_size=job["cohort"], val_cohort_size=None)
    model = FedAvgNoLocalEval().run(algorithm_params=algorithm_params, backend=backend, model=model,
                                    model_train_params=train_params, callbacks=[])
    if os.environ.get(RANK, "0") == "0":  # every rank holds the same central model: rank 0 tests it
        test_x = load(data, "t10k-images-idx3-ubyte")
        test_y = torch.from_numpy(load(data, "t10k-labels-idx1-ubyte").astype(np.int64))
        result = model.evaluate(PyTorchTensorDataset((normalized(test_x), test_y)),
                                eval_params=NNEvalHyperParams(local_batch_size=1000))
        print(json.dumps({name: float(result[StringMetricName(name)].overall_value) for name in ("loss", "accuracy")}),
              flush=True)
    failed = [w.args for w in workers if w.wait()]
    if failed:
        raise SystemExit(f"pfl worker failed: {failed}")


if __name__ == "__main__":
    main(parse())
