"""Differential privacy by hand: DP-SGD's per-example clipping and noise against a loop over the
examples, the accountant against Opacus' own, central DP's clipping and noise, the settings'
small languages and their refusals; and both engines equal, with DP off and on (their noise is the
same, drawn from each node's seeded generator)."""

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from meshlearn.config import ExperimentConfig
from meshlearn.errors import ConfigError
from meshlearn.privacy.accountant import ORDERS, epsilon, noise_multiplier_for
from meshlearn.privacy.budget import PrivacyBudget
from meshlearn.privacy.central import clip_update, noised
from meshlearn.privacy.dpsgd import PrivateGradients, check_model, noise_generator, noisy_mean, private_step
from meshlearn.privacy.settings import CentralDPSettings, DPSettings
from meshlearn.sgd import StackedSGD


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _batch(size=7):
    torch.manual_seed(1)
    return torch.randn(size, 6) * 3, torch.randint(0, 3, (size,))


def _by_hand(model, x, y, clip):
    """Each example's gradient by its own backward pass, clipped to ``clip``, summed."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]).backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        norms.append(float(norm))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        total = [t + g * factor for t, g in zip(total, grads)]
    return torch.cat([t.reshape(-1) for t in total]), norms


@pytest.mark.parametrize("clip", [0.05, 1000.0])  # every example clipped; none
def test_clipped_sum_is_each_examples_gradient_clipped_and_summed(clip):
    model, (x, y) = _model(), _batch()
    expected, norms = _by_hand(model, x, y, clip)
    assert (min(norms) > clip) if clip < 1 else (max(norms) < clip)
    private = PrivateGradients(model, clip)
    sums, loss = private.clipped_sum({n: p.detach() for n, p in model.named_parameters()}, {}, x, y)
    got = torch.cat([sums[n].reshape(-1) for n, _ in model.named_parameters()])
    assert torch.allclose(got, expected, atol=1e-6)
    assert float(loss) == pytest.approx(float(nn.functional.cross_entropy(model(x), y).detach()), rel=1e-5)


def test_noise_is_gaussian_of_noise_times_clip_over_the_batch_and_one_step_is_sgd_on_it():
    sums = torch.arange(4, dtype=torch.float32)
    noisy = noisy_mean(sums.clone(), 1.5, 0.5, 8, noise_generator(3, 2))
    draw = torch.randn(4, generator=noise_generator(3, 2))
    assert torch.allclose(noisy, (sums + 1.5 * 0.5 * draw) / 8)
    assert not torch.equal(draw, torch.randn(4, generator=noise_generator(3, 1)))  # each node its own noise

    model, (x, y) = _model(), _batch()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    expected_sum, _ = _by_hand(model, x, y, 1.0)
    noise = torch.randn(flat.numel(), generator=noise_generator(0, 0))
    expected = flat - 0.1 * (expected_sum + 2.0 * 1.0 * noise) / 7
    params = torch.nn.utils.parameters_to_vector(model.parameters()).unsqueeze(0)
    torch.nn.utils.vector_to_parameters(params[0], model.parameters())  # the model's tensors view the row
    for p, view in zip(model.parameters(), _views(params[0], model)):
        p.data = view
    private_step(model, [n for n, _ in model.named_parameters()], PrivateGradients(model, 1.0), StackedSGD(params, 0.1),
                 x, y, 2.0, 7, noise_generator(0, 0))
    assert torch.allclose(params[0], expected, atol=1e-5)


def _views(row, model):
    views, at = [], 0
    for p in model.parameters():
        views.append(row[at:at + p.numel()].view_as(p))
        at += p.numel()
    return views


def test_the_accountant_agrees_with_opacus_order_for_order():
    opacus = pytest.importorskip("opacus.accountants")
    for noise, rate, steps in [(1.0, 0.01, 1000), (0.6, 64 / 7500, 2000), (2.0, 0.1, 50), (1.1, 1.0, 10)]:
        theirs = opacus.RDPAccountant()
        theirs.history = [(noise, rate, steps)]
        expected, _ = theirs.get_privacy_spent(delta=1e-5, alphas=list(ORDERS))
        assert epsilon(noise, rate, steps, 1e-5) == pytest.approx(expected, rel=1e-9)
        # Opacus' default orders add fractional ones: its epsilon is at most ours, and close to it
        assert theirs.get_epsilon(1e-5) <= epsilon(noise, rate, steps, 1e-5) <= 1.1 * theirs.get_epsilon(1e-5)


def test_the_noise_for_a_budget_spends_it():
    noise = noise_multiplier_for(8.0, 1e-5, 64 / 6000, 1875)
    assert epsilon(noise, 64 / 6000, 1875, 1e-5) <= 8.0 < epsilon(noise * 0.999, 64 / 6000, 1875, 1e-5)
    budget = PrivacyBudget.of(DPSettings.model_validate("epsilon=8,delta=1e-5"), 64, 6000, 1875)
    assert budget.noise_multiplier == noise and budget.epsilon(1875) <= 8 and budget.epsilon(0) == 0
    with pytest.raises(ConfigError, match="cannot be met"):
        noise_multiplier_for(1e-6, 1e-5, 1.0, 10_000)


def test_central_dp_clips_updates_and_noises_parameters_only():
    start, state = torch.zeros(6), torch.tensor([3.0, 4.0, 0.0, 0.0, 9.0, 9.0])  # 4 parameters, 2 buffers
    clip_update(state, start, 4, 1.0)
    assert torch.allclose(state, torch.tensor([0.6, 0.8, 0.0, 0.0, 9.0, 9.0]))
    generator = torch.Generator().manual_seed(5)
    noisy = noised(state, 4, 2.0, 1.0, 4, generator)
    draw = torch.randn(4, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(noisy[:4], state[:4] + draw * 0.5) and torch.equal(noisy[4:], state[4:])


def test_the_settings_languages_and_their_refusals():
    assert DPSettings.model_validate("epsilon=8,delta=1e-5").spec == "epsilon=8.0,delta=1e-05,max_grad_norm=1.0"
    assert not DPSettings.model_validate("none").active
    assert CentralDPSettings.model_validate("noise_multiplier=1,clip=0.5").spec == \
        "noise_multiplier=1.0,clip=0.5,delta=1e-05"
    for text, message in [("epsilon=8,noise_multiplier=1", "not both"), ("delta=1e-5", "give epsilon"),
                          ("budget=8", "is not KEY=VALUE"), ("epsilon=eight", "must be a number")]:
        with pytest.raises(ConfigError, match=message):
            ExperimentConfig(dp=text)
    with pytest.raises(ConfigError, match="central_dp needs leader_weighting equal"):
        ExperimentConfig(algorithm="leader", leader_sync=True, central_dp="noise_multiplier=1")
    with pytest.raises(ConfigError, match="BatchNorm"):
        from meshlearn.models import build_model

        check_model(build_model("resnet18", (3, 32, 32), 10))


def _simulate(folder, engine, dp):
    done = subprocess.run([sys.executable, "-m", "meshlearn", "simulate", "--engine", engine, "--nodes", "3",
                           "--algorithm", "dpsgd", "--dataset", "digits", "--model", "mlp", "--iterations", "2",
                           "--rounds", "2", "--lr", "0.1", "--seed", "4", "--dp", dp, "--output", str(folder)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads((folder / "summary.json").read_text())


@pytest.mark.parametrize("dp", [  # DP off: test_batched compares both engines on every algorithm in the default run
    pytest.param("none", marks=pytest.mark.slow), "noise_multiplier=1.2,max_grad_norm=0.8,seeded=true"])
def test_both_engines_train_alike_with_dp_off_and_on(tmp_path, dp):
    process, batched = (_simulate(tmp_path / engine, engine, dp) for engine in ("process", "batched"))
    assert process["final"]["loss"] == pytest.approx(batched["final"]["loss"], rel=1e-4)
    if dp == "none":
        assert "privacy" not in process and "privacy" not in batched
    else:
        assert process["privacy"] == pytest.approx(batched["privacy"])
        assert process["privacy"]["steps"] == 4 and process["privacy"]["epsilon"] > 0
        evaluations = [json.loads(line) for line in (tmp_path / "process" / "logs" / "node_0.jsonl").open()
                       if '"eval"' in line]
        spent = [e["epsilon"] for e in evaluations if e.get("event") == "eval"]
        assert spent == sorted(spent) and spent[-1] == pytest.approx(process["privacy"]["epsilon"], rel=0.5)
