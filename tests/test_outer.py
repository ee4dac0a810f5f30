"""Outer optimizers (DiLoCo, FedOpt): the setting's language, and each step by hand."""

import pytest
import torch

from meshlearn.errors import ConfigError
from meshlearn.outer import OuterOptimizer


def test_the_outer_setting_is_parsed_once_with_each_kinds_defaults():
    assert OuterOptimizer.model_validate("none") == OuterOptimizer() and not OuterOptimizer().active
    diloco = OuterOptimizer.model_validate("nesterov")
    assert (diloco.kind, diloco.lr, diloco.momentum) == ("nesterov", 0.7, 0.9) and diloco.active
    assert OuterOptimizer.model_validate("nesterov:lr=0.5").momentum == 0.9
    adam = OuterOptimizer.model_validate("adam:lr=0.1,beta2=0.999")
    assert (adam.lr, adam.beta1, adam.beta2, adam.eps) == (0.1, 0.9, 0.999, 1e-3)
    assert OuterOptimizer.model_validate("sgd:momentum=0.9,nesterov=true").nesterov
    for text in ("nesterov:lr=0.5", "adam:lr=0.1,beta2=0.999", "sgd:lr=1,momentum=0.9,nesterov=true", "yogi", "none"):
        written = OuterOptimizer.model_validate(text).model_dump()
        assert OuterOptimizer.model_validate(written) == OuterOptimizer.model_validate(text), written  # round trip
    from_yaml = OuterOptimizer.model_validate({"kind": "nesterov", "lr": 0.5})  # a map: its kind's defaults too
    assert (from_yaml.lr, from_yaml.momentum, from_yaml.spec) == (0.5, 0.9, "nesterov:lr=0.5,momentum=0.9")
    assert OuterOptimizer.model_validate({"kind": "adam"}).lr == 0.01
    assert OuterOptimizer.model_validate("adam:lr=0.0123456789").spec.startswith("adam:lr=0.0123456789,")  # exact
    with pytest.raises(ConfigError, match="momentum is not one of its options"):
        OuterOptimizer.model_validate({"kind": "adam", "momentum": 0.9})
    for bad, problem in (("lamb", "write one of none, sgd"), ("adam:momentum=0.9", "not one of adam's options"),
                         ("sgd:lr=fast", "lr must be a number"), ("sgd:nesterov=maybe", "true or false"),
                         ("nesterov:nesterov=false", "not one of nesterov's options")):
        with pytest.raises(ConfigError, match=problem):
            OuterOptimizer.model_validate(bad)


def _rounds(outer: OuterOptimizer, start: torch.Tensor, aggregates: list[torch.Tensor]) -> list[torch.Tensor]:
    state = outer.begin(start)
    models = []
    for aggregate in aggregates:
        model = aggregate.clone()
        outer.step(model, state)
        assert torch.equal(state["before"], model)  # the next round starts from the new model
        models.append(model)
    return models


START = torch.tensor([[1.0, -2.0, 0.5]])
AGGREGATES = [torch.tensor([[0.5, -1.0, 0.5]]), torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[1.0, 1.0, 1.0]])]


def test_none_takes_the_aggregate_and_plain_sgd_at_lr_1_is_none():
    for outer in (OuterOptimizer(), OuterOptimizer.model_validate("sgd:lr=1")):
        assert all(torch.equal(m, a) for m, a in zip(_rounds(outer, START, AGGREGATES), AGGREGATES))


def test_nesterov_momentum_by_hand():
    lr, mu = 0.7, 0.9
    x, buffer, expected = START.clone(), torch.zeros_like(START), []
    for aggregate in AGGREGATES:  # what DiLoCo's outer step is: torch's SGD(nesterov) on x - aggregate
        g = x - aggregate
        buffer = mu * buffer + g
        x = x - lr * (g + mu * buffer)
        expected.append(x)
    got = _rounds(OuterOptimizer.model_validate("nesterov:lr=0.7,momentum=0.9"), START, AGGREGATES)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, expected))
    # and the same as torch.optim.SGD stepping on the pseudo-gradients
    param = START.clone().requires_grad_()
    sgd = torch.optim.SGD([param], lr=lr, momentum=mu, nesterov=True)
    for aggregate, model in zip(AGGREGATES, got):
        param.grad = param.detach() - aggregate
        sgd.step()
        assert torch.allclose(param.detach(), model, atol=1e-6)


@pytest.mark.parametrize("kind", ["adam", "yogi"])
def test_adam_and_yogi_by_hand_as_reddi_et_al_write_them(kind):
    lr, b1, b2, eps = 0.1, 0.9, 0.99, 1e-3
    x, m, v, expected = START.clone(), torch.zeros_like(START), torch.full_like(START, eps ** 2), []
    for aggregate in AGGREGATES:
        delta = aggregate - x  # Reddi et al.'s Delta: the clients' mean change
        m = b1 * m + (1 - b1) * delta
        if kind == "adam":
            v = b2 * v + (1 - b2) * delta ** 2
        else:
            v = v - (1 - b2) * delta ** 2 * torch.sign(v - delta ** 2)
        x = x + lr * m / (v.sqrt() + eps)
        expected.append(x)
    got = _rounds(OuterOptimizer.model_validate(f"{kind}:lr=0.1"), START, AGGREGATES)
    assert all(torch.allclose(g, e, atol=1e-6) for g, e in zip(got, expected))
    assert not torch.allclose(got[-1], AGGREGATES[-1])


def test_an_outer_step_follows_each_exchange_in_a_run_and_none_is_todays_run(tmp_path):
    from helpers.engines import BASE, batched_states

    from meshlearn.config import make_config

    values = {**BASE, "algorithm": "fedavg", "iterations": 3}
    plain = batched_states(values, tmp_path / "plain", "on")
    assert torch.equal(batched_states({**values, "outer": "none"}, tmp_path / "none", "on"), plain)
    assert torch.allclose(batched_states({**values, "outer": "sgd:lr=1"}, tmp_path / "sgd1", "on"), plain, atol=1e-6)
    start = batched_states({**values, "iterations": 1, "rounds": 0}, tmp_path / "start", "on")[0]
    one = batched_states({**values, "iterations": 1}, tmp_path / "one", "on")[0]
    outer = batched_states({**values, "iterations": 1, "outer": "sgd:lr=0.5"}, tmp_path / "half", "on")
    assert torch.allclose(outer[0], start + 0.5 * (one - start), atol=1e-6)  # half of the way to the aggregate
    assert all(torch.equal(row, outer[0]) for row in outer)  # every node: the same global model
    with pytest.raises(ConfigError, match="algorithm pushsum needs outer none .not nesterov:lr=0.7,momentum=0.9."):
        make_config({"algorithm": "pushsum", "outer": "nesterov"})
    with pytest.raises(ConfigError, match="outer"):
        make_config({"algorithm": "fedavg", "outer": "sgd:lr=-1"})


def test_gossip_takes_each_nodes_outer_step_when_it_finishes_an_iteration(tmp_path):
    from helpers.engines import BASE, batched_states

    values = {**BASE, "algorithm": "gossip", "iterations": 1, "rounds": 3, "fetch_probability": 1.0}
    start = batched_states({**values, "rounds": 0}, tmp_path / "start", "on")
    plain = batched_states(values, tmp_path / "plain", "on")
    assert not torch.allclose(plain, start)
    half = batched_states({**values, "outer": "sgd:lr=0.5"}, tmp_path / "half", "on")
    assert torch.allclose(half, start + 0.5 * (plain - start), atol=1e-6)  # each node: half of its way
