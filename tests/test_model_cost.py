"""The batched engine's cost model of a step (meshlearn.models.cost): the same FLOPs as torch's
FlopCounterMode for every built-in model and a user's, without importing torch._dynamo (about a
second of every run); and a whole batched run that imports it nowhere."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.nn import functional as F

from meshlearn.models import build_model
from meshlearn.models.cost import step_flops

BATCH = 3  # samples per counted step: enough to tell a per-sample count from a per-batch one

# each built-in model on a sample it reads: (name, sample shape, sample dtype, classes)
ZOO = [("mlp", (1, 28, 28), torch.float32, 10), ("lenet", (3, 32, 32), torch.float32, 10),
       ("simplecnn", (3, 32, 32), torch.float32, 10), ("resnet18", (3, 32, 32), torch.float32, 10),
       ("gpt-tiny", (16,), torch.int64, 256), ("gpt-small", (16,), torch.int64, 256)]


def _torch_count(model: torch.nn.Module, sample: torch.Tensor, batch_size: int) -> int:
    """The FLOPs torch's own FlopCounterMode counts for one step, as step_flops counted them before
    it stopped importing torch._dynamo: on the meta device, on the CPU for a model meta cannot run."""
    from torch.utils.flop_counter import FlopCounterMode

    for device in ("meta", "cpu"):
        try:
            alone = copy.deepcopy(model).to(device)
            x = torch.zeros((batch_size, *sample.shape), dtype=sample.dtype, device=device)
            with FlopCounterMode(display=False) as counter:
                outputs = alone(x)
                targets = torch.zeros(outputs.shape[:-1], dtype=torch.int64, device=device)
                F.cross_entropy(outputs.flatten(0, -2), targets.flatten()).backward()
            return int(counter.get_total_flops())
        except (NotImplementedError, RuntimeError):
            assert device == "meta"
    raise AssertionError("unreachable")


class _Convolves(torch.nn.Module):
    """A user's model convolving every way the zoo does not: 1-d and 3-d, strided, dilated,
    grouped, transposed (with an output padding), without a bias."""

    def __init__(self):
        super().__init__()
        self.one = torch.nn.Conv1d(2, 4, 3, stride=2, padding=2, dilation=2, groups=2)
        self.up = torch.nn.ConvTranspose1d(4, 6, 4, stride=3, padding=1, output_padding=2, bias=False)
        self.three = torch.nn.Conv3d(1, 2, (1, 2, 3), stride=(1, 2, 1), padding=(0, 1, 1))
        self.head = torch.nn.Linear(2 * 2 * 4 * 16, 5)

    def forward(self, x):  # x [B, 2, 9]
        h = self.up(self.one(x))  # [B, 4, 5], then [B, 6, 16]
        h = self.three(h.unsqueeze(1).unsqueeze(1).expand(-1, 1, 2, -1, -1))  # [B, 2, 2, 4, 16]
        return self.head(h.flatten(1))


class _Attends(torch.nn.Module):
    """A user's model calling torch's fused attention and a convolution (ops the zoo does not use)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, 3, padding=1)
        self.head = torch.nn.Linear(8, 5)

    def forward(self, x):  # x [B, 4, 6]
        h = self.conv(x).transpose(1, 2)  # [B, 6, 8]
        h = F.scaled_dot_product_attention(h, h, h, is_causal=True)
        return self.head(h.mean(1))


class _ReadsValues(torch.nn.Module):
    """A user's model the meta device cannot run (it reads a value): counted on the CPU."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x) * (1.0 if float(x.sum()) >= 0 else 2.0)


@pytest.mark.parametrize("name,shape,dtype,classes", ZOO, ids=[z[0] for z in ZOO])
def test_a_built_in_models_step_costs_what_torchs_counter_says(name, shape, dtype, classes):
    model = build_model(name, shape, classes)
    sample = torch.zeros(shape, dtype=dtype)
    counted = step_flops(model, sample, BATCH)
    assert counted > 0
    assert counted == _torch_count(model, sample, BATCH)


@pytest.mark.parametrize("model,shape", [(_Attends(), (4, 6)), (_Convolves(), (2, 9)), (_ReadsValues(), (4,))],
                         ids=["attends", "convolves", "reads"])
def test_a_users_models_step_costs_what_torchs_counter_says(model, shape):
    counted = step_flops(model, torch.zeros(shape), BATCH)
    assert counted > 0
    assert counted == _torch_count(model, torch.zeros(shape), BATCH)


def test_counting_a_step_leaves_torch_dynamo_unimported():
    # a fresh interpreter: this one's FlopCounterMode above imported it
    script = textwrap.dedent("""
        import sys, torch
        from meshlearn.models import build_model
        from meshlearn.models.cost import step_flops
        flops = step_flops(build_model("lenet", (1, 8, 8), 10), torch.zeros(1, 8, 8), 4)
        print(flops, "torch._dynamo" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    flops, imported = done.stdout.split()
    assert int(flops) > 0
    assert imported == "False"


@pytest.mark.parametrize("model", ["lenet"])  # convolving nodes, trained one after another on the CPU
def test_a_batched_fedavg_run_never_imports_torch_dynamo(tmp_path, model):
    script = textwrap.dedent(f"""
        import sys
        from meshlearn.cli.main import main
        code = main(["simulate", "--quiet", "--engine", "batched", "--algorithm", "fedavg", "--nodes", "4",
                     "--dataset", "digits", "--model", "{model}", "--iterations", "2", "--test-after", "2",
                     "--output", {str(tmp_path / "run")!r}])
        print(code, "torch._dynamo" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["0", "False"], done.stdout[-2000:]
    assert (tmp_path / "run" / "summary.json").is_file()
