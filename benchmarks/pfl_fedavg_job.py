"""The pfl-research side of `fedavg_vs_pfl.py`: one FedAvg job in Apple's pfl (0.6.0), PyTorch backend.

Run by `fedavg_vs_pfl.py` with the python of its pfl virtual environment, never imported by meshlearn:

    python pfl_fedavg_job.py JOBDIR

JOBDIR (written by the driver) holds `data.npz` (Fashion-MNIST decoded: uint8 images, labels),
`split.npz` (every client's training-sample indices, `part_<i>`, and each central iteration's cohort,
`cohorts`), `init.pt` (the initial weights) and `job.json` (hyperparameters and the normalization).
The job imports neither meshlearn nor the driver: pfl, torch and numpy only. It prints one JSON line,
the central model's loss and accuracy on the 10,000 test images after the last central iteration.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

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

    def get_next_central_contexts(self, *args, **kwargs):
        """The contexts of FederatedAveraging, with `do_evaluation` off."""
        contexts, model, extra = super().get_next_central_contexts(*args, **kwargs)
        if contexts is not None:
            contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
        return contexts, model, extra


def cohort_sampler(cohorts: np.ndarray):
    """pfl's `user_sampler` interface (a callable giving the next user id): the given cohorts' users,
    iteration after iteration (the same draws as meshlearn's FedAvg, from the driver)."""
    order = iter(cohorts.reshape(-1).tolist())
    return lambda: next(order)


def local_schedule(sizes: list[int], batch: int, steps: int) -> dict:
    """`local_num_steps` or `local_num_epochs` giving every client exactly `steps` local steps of
    `batch` samples (a short last batch per pass, as meshlearn). pfl's `local_num_steps` stops at the end
    of one pass over the client's data, so when `steps` batches need more than one pass, whole epochs."""
    smallest, largest = min(sizes), max(sizes)
    if steps * batch <= smallest:
        return {"local_num_steps": steps, "local_num_epochs": None}
    per_epoch = {-(-n // batch) for n in (smallest, largest)}
    if len(per_epoch) == 1 and steps % (bpe := per_epoch.pop()) == 0:
        return {"local_num_steps": None, "local_num_epochs": steps // bpe}
    raise SystemExit(f"pfl cannot take {steps} local steps of {batch} on clients of {smallest}..{largest} samples: "
                     "choose --rounds as a whole number of passes over a client's data")


def main(folder: Path) -> None:
    """Build the federated dataset, model and algorithm, run FedAvg, print the test metrics."""
    job = json.loads((folder / "job.json").read_text())
    torch.manual_seed(job["seed"])
    np.random.seed(job["seed"])
    data, split = np.load(folder / "data.npz"), np.load(folder / "split.npz")
    train_x, train_y = data["train_x"], torch.from_numpy(data["train_y"].astype(np.int64))
    parts = [split[f"part_{i}"] for i in range(job["clients"])]
    mean, std = job["mean"], job["std"]

    def normalized(x: np.ndarray) -> torch.Tensor:
        """uint8 images to float32, scaled and normalized as meshlearn does."""
        return (torch.from_numpy(np.asarray(x, dtype=np.float32)) / 255.0 - mean) / std

    def make_dataset(user: int) -> PyTorchTensorDataset:
        """A client's data, built when the client is drawn (pfl's `make_dataset_fn`)."""
        index = parts[user]
        return PyTorchTensorDataset((normalized(train_x[index]), train_y[index]), user_id=str(user))

    training = FederatedDataset(make_dataset, cohort_sampler(split["cohorts"]))
    module = MLP(int(np.prod(train_x.shape[1:])), 10)
    module.load_state_dict(torch.load(folder / "init.pt", weights_only=True))
    module.loss = types.MethodType(loss, module)
    module.metrics = types.MethodType(metrics, module)
    params = [p for p in module.parameters() if p.requires_grad]
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(params, job["server_lr"]))
    backend = SimulatedBackend(training_data=training, val_data=None, postprocessors=[WeightByDatapoints()])
    train_params = NNTrainHyperParams(local_learning_rate=job["lr"], local_batch_size=job["batch_size"],
                                      **local_schedule([len(p) for p in parts], job["batch_size"], job["steps"]))
    algorithm_params = NNAlgorithmParams(central_num_iterations=job["iterations"],
                                         evaluation_frequency=job["iterations"],
                                         train_cohort_size=job["cohort"], val_cohort_size=None)
    model = FedAvgNoLocalEval().run(algorithm_params=algorithm_params, backend=backend, model=model,
                                    model_train_params=train_params, callbacks=[])
    test = PyTorchTensorDataset((normalized(data["test_x"]), torch.from_numpy(data["test_y"].astype(np.int64))))
    result = model.evaluate(test, eval_params=NNEvalHyperParams(local_batch_size=1000))
    print(json.dumps({name: float(result[StringMetricName(name)].overall_value) for name in ("loss", "accuracy")}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
