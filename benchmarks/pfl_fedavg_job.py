"""The pfl-research side of `fedavg_vs_pfl.py`: one FedAvg job in Apple's pfl (0.6.0), PyTorch backend.

Run by `fedavg_vs_pfl.py` with the python of its pfl virtual environment, never imported by meshlearn:

    python pfl_fedavg_job.py JOBDIR [--threads N] [--processes P]
    python pfl_fedavg_job.py JOBDIR --check-users K,K,...

JOBDIR (written by the driver) holds `split.npz` (each central iteration's cohort, `cohorts`; each
drawn client's training samples, `weights`, beside it; and the samples each drawn client trains on
in that iteration, batch by batch: `picks`, `sizes`), `init.pt` (the initial weights) and `job.json`
(hyperparameters, the normalization and the data set). The data set is one of:
- Fashion-MNIST, whose IDX files (the folder `data`) this job decodes itself, as meshlearn's run
  does; `picks` are indices into its training set;
- the synthetic federated data set of the FedProx paper / LEAF (`synthetic`, ALPHA `alpha`, BETA
  `beta`, `users` users, one per client), generated here from the seed with this job's own copy of
  the formula (`synthetic_user`): each drawn user's samples when it is drawn, never a user not
  drawn; `picks` are indices into that user's training samples. `--check-users` prints digests of
  the size table, of those users' training samples and of the test set, and stops: the driver
  compares them with meshlearn's generator before timing anything.

The data order is meshlearn's: a client does not restart its shard each time it is drawn (pfl's
`Dataset` would hand it the same first batches every time) but takes the next batches of its own
endless, per-epoch reshuffled stream (`ShardLoaders` in meshlearn, drawn by the driver), so both
systems compute the same steps on the same samples. Each drawn client's `Dataset` yields exactly
those batches and counts its training samples as its data points (FedAvg's weight, as meshlearn's).

`--threads N`: torch's intra-op threads (and OMP_NUM_THREADS) of each process. `--processes P`:
pfl's own distributed simulation ("Fast distributed simulations" in pfl's guide: one process per
worker, `PFL_WORKER_ADDRESSES` / `PFL_WORKER_RANK`, the cohort's users split among them, their
statistics summed with torch.distributed over gloo on this machine); this process is rank 0 and
starts the others, and waits for them, so that their CPU time is counted with its own.

The job imports neither meshlearn nor the driver: pfl, torch and numpy only. Rank 0 prints one JSON
line, the central model's loss and accuracy on the test set after the last iteration.
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
    parser.add_argument("--check-users", type=lambda text: [int(k) for k in text.split(",")], metavar="K,K,...",
                        help="synthetic data: print digests of the generator's output for these users, then stop")
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


# The synthetic federated data set of the FedProx paper / LEAF, per user from the seed: the formula
# meshlearn's `meshlearn.data.synthetic` implements, written out again because this job never
# imports meshlearn. The driver checks before timing that both give the same arrays (`--check-users`).
SYNTHETIC_DIM, SYNTHETIC_CLASSES = 60, 10  # features of a sample, classes
MAX_USER_SAMPLES = 1000  # a user's train and test samples together, at most
TEST_USERS = 200  # the test set: the test samples of the first 200 users
SYNTHETIC_SALT = 0x5EED  # keeps the generator's draws apart from the run's other draws of the seed


def synthetic_totals(seed: int, users: int):
    """Each user's train and test samples together (np.int64 [users]); user k's is the same in every
    population of more than k users (the draws are sequential)."""
    import numpy as np

    drawn = np.random.default_rng([seed, SYNTHETIC_SALT, 0]).lognormal(4.0, 2.0, users)
    return np.minimum(drawn.astype(np.int64) + 50, MAX_USER_SAMPLES)


def train_count(total):
    """A user's training samples of ``total``: all but the last tenth (LEAF's 90/10 split)."""
    return total - total // 10


def synthetic_user(seed: int, alpha: float, beta: float, user: int, total: int):
    """User ``user``'s ``total`` samples, training samples first: x float32 [total, 60], y int64."""
    import numpy as np

    rng = np.random.default_rng([seed, SYNTHETIC_SALT, 1, user])
    u = rng.normal(0.0, alpha)
    b_mean = rng.normal(0.0, beta)
    w = rng.normal(u, 1.0, (SYNTHETIC_DIM, SYNTHETIC_CLASSES))
    b = rng.normal(u, 1.0, SYNTHETIC_CLASSES)
    v = rng.normal(b_mean, 1.0, SYNTHETIC_DIM)
    sigma = np.arange(1, SYNTHETIC_DIM + 1, dtype=np.float64) ** -1.2  # the inputs' covariance (diagonal)
    x = rng.normal(0.0, 1.0, (total, SYNTHETIC_DIM)) * np.sqrt(sigma) + v
    return x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int64)


def synthetic_test(seed: int, alpha: float, beta: float, totals):
    """The test set: the test samples of users 0 .. min(users, TEST_USERS) - 1, user after user."""
    import numpy as np

    parts = [synthetic_user(seed, alpha, beta, k, int(totals[k])) for k in range(min(len(totals), TEST_USERS))]
    kept = [train_count(int(totals[k])) for k in range(len(parts))]
    return (np.concatenate([x[n:] for (x, _), n in zip(parts, kept)]),
            np.concatenate([y[n:] for (_, y), n in zip(parts, kept)]))


def digest(*arrays) -> str:
    """A SHA-256 of arrays' bytes (C order), to compare two generators' output without sending it."""
    import hashlib

    import numpy as np

    hashed = hashlib.sha256()
    for array in arrays:
        hashed.update(np.ascontiguousarray(array).tobytes())
    return hashed.hexdigest()


def check_users(job: dict, users: list[int]) -> dict:
    """Digests of the synthetic data this job generates: the training sizes of every user (`sizes`),
    the training samples of each of ``users`` (x as float32 [n, 60], y as int64) and the test set."""
    seed, alpha, beta = job["seed"], job["alpha"], job["beta"]
    totals = synthetic_totals(seed, job["users"])
    trains = {}
    for k in users:
        x, y = synthetic_user(seed, alpha, beta, k, int(totals[k]))
        n = train_count(int(totals[k]))
        trains[str(k)] = digest(x[:n], y[:n])
    return {"sizes": digest(train_count(totals)), "users": trains, "test": digest(*synthetic_test(seed, alpha, beta, totals))}


class FashionMNIST:
    """The job's Fashion-MNIST: its training set held whole (``picks`` index it), its test set read
    once at the end; images normalized as meshlearn does."""

    inputs = 28 * 28

    def __init__(self, job: dict):
        import numpy as np

        self.folder, self.mean, self.std = Path(job["data"]), job["mean"], job["std"]
        self.train_x = load(self.folder, "train-images-idx3-ubyte")
        self.train_y = load(self.folder, "train-labels-idx1-ubyte").astype(np.int64)

    def normalized(self, x):
        """uint8 images to float32, scaled and normalized as meshlearn does."""
        import numpy as np
        import torch

        return (torch.from_numpy(np.asarray(x, dtype=np.float32)) / 255.0 - self.mean) / self.std

    def train(self, client: int, index):
        """The training samples ``index`` (training-set indices) as (inputs, labels) tensors."""
        import torch

        return self.normalized(self.train_x[index]), torch.from_numpy(self.train_y[index])

    def test(self):
        """The 10,000 test images and labels as tensors."""
        import numpy as np
        import torch

        x = load(self.folder, "t10k-images-idx3-ubyte")
        return self.normalized(x), torch.from_numpy(load(self.folder, "t10k-labels-idx1-ubyte").astype(np.int64))


class Synthetic:
    """The job's synthetic population: only its size table held; a drawn user generated when drawn."""

    inputs = SYNTHETIC_DIM

    def __init__(self, job: dict):
        self.seed, self.alpha, self.beta = job["seed"], job["alpha"], job["beta"]
        self.mean, self.std = job["mean"], job["std"]
        self.totals = synthetic_totals(self.seed, job["users"])

    def tensors(self, x, y):
        """Samples as meshlearn's models read them: x float32 [n, 1, 1, 60] normalized, y int64."""
        import torch

        return (torch.from_numpy(x).reshape(-1, 1, 1, SYNTHETIC_DIM) - self.mean) / self.std, torch.from_numpy(y)

    def train(self, client: int, index):
        """User ``client``'s training samples ``index`` (indices into them), generated now."""
        x, y = synthetic_user(self.seed, self.alpha, self.beta, client, int(self.totals[client]))
        if len(index) and index.max() >= train_count(int(self.totals[client])):
            raise SystemExit(f"user {client}'s picks reach past its {train_count(int(self.totals[client]))} training samples")
        return self.tensors(x[index], y[index])

    def test(self):
        """The test set (``synthetic_test``)."""
        return self.tensors(*synthetic_test(self.seed, self.alpha, self.beta, self.totals))


SOURCES = {"fashion-mnist": FashionMNIST, "synthetic": Synthetic}  # job.json's "dataset": its data here


def main(args: argparse.Namespace) -> None:
    """Build the federated dataset, model and algorithm, run FedAvg, print the test metrics (with
    ``--check-users``: print the synthetic generator's digests instead, pfl not even imported)."""
    if args.check_users is not None:
        print(json.dumps(check_users(json.loads((args.folder / "job.json").read_text()), args.check_users)))
        return
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
        """meshlearn's `mlp` on ``inputs`` features, layer for layer (so its state dict loads as it is)."""

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
    source = SOURCES[job["dataset"]](job)
    cohorts, weights, picks = split["cohorts"].reshape(-1), split["weights"].reshape(-1), split["picks"]
    sizes = split["sizes"].reshape(len(cohorts), -1)  # per drawn client: its batches' sizes
    offsets = np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])

    def positions():
        """pfl's `user_sampler` (a callable giving the next user): the position of the next draw in
        the cohorts laid end to end (iteration t's j-th client is t * cohort + j), so that the
        dataset built for it is that client's batches of that iteration, on every rank."""
        order = iter(range(len(cohorts)))
        return lambda: next(order)

    def make_dataset(position: int) -> StreamDataset:
        """The drawn client's batches of this iteration (pfl's `make_dataset_fn`), its data made now."""
        client = int(cohorts[position])
        return StreamDataset(source.train(client, picks[offsets[position]:offsets[position + 1]]),
                             sizes[position].tolist(), int(weights[position]), str(client))

    training = FederatedDataset(make_dataset, positions())
    module = MLP(source.inputs, 10)
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
        result = model.evaluate(PyTorchTensorDataset(source.test()),
                                eval_params=NNEvalHyperParams(local_batch_size=1000))
        print(json.dumps({name: float(result[StringMetricName(name)].overall_value) for name in ("loss", "accuracy")}),
              flush=True)
    failed = [w.args for w in workers if w.wait()]
    if failed:
        raise SystemExit(f"pfl worker failed: {failed}")


if __name__ == "__main__":
    main(parse())
