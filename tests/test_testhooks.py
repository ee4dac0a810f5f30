"""The provider's test-only switches (``network/provider/testhooks.py``): read from the environment
once, where ``meshlearn provider`` builds its provider, then passed down; a bad value is one line
naming its variable, and no other module of meshlearn reads them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.netproc import free_port

from meshlearn.errors import UserInputError
from meshlearn.netem import NetemSpec
from meshlearn.network.provider import testhooks
from meshlearn.network.provider.service import Provider, ProviderSettings
from meshlearn.network.provider.testhooks import NO_HOOKS, TestHooks

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlearn"
SECRET = b"testhooks-secret"
NOWHERE = "127.0.0.1:9"  # a bootstrap address nothing here dials: the provider is built, never started
SWITCHES = (testhooks.POISON_ENV, testhooks.NET_ENV, testhooks.DEVICE_ENV)


def _provider(tmp_path, **kwargs) -> Provider:
    return Provider(ProviderSettings(bootstrap=NOWHERE, provider_id="p0", workdir=str(tmp_path / "p0")), SECRET,
                    **kwargs)


def test_the_switches_are_read_once_where_the_provider_is_built_and_passed_down(tmp_path, monkeypatch):
    monkeypatch.setenv(testhooks.POISON_ENV, "sign-flip:10")
    monkeypatch.setenv(testhooks.NET_ENV, "loss=20%,delay=200ms")
    monkeypatch.setenv(testhooks.DEVICE_ENV, "cuda")
    hooks = TestHooks.from_environment()
    assert hooks == TestHooks("sign-flip:10", NetemSpec(loss=0.2, delay=0.2), "cuda")
    provider, plain = _provider(tmp_path, hooks=hooks), _provider(tmp_path)
    for name in SWITCHES:  # changed after the start: nothing reads the environment again
        monkeypatch.setenv(name, "nonsense")
    assert provider.declared_device == "cuda" and provider._task_context().hooks is hooks
    assert plain.declared_device == plain.device == "cpu" and plain._task_context().hooks == NO_HOOKS
    assert TestHooks.from_environment({}) == NO_HOOKS  # none set: no hooks


@pytest.mark.parametrize("name, value, problem", [
    (testhooks.POISON_ENV, "bogus:3", "BEHAVIOUR one of sign-flip"),
    (testhooks.NET_ENV, "loss=lots", "must be a share like 20%"),
    (testhooks.DEVICE_ENV, "gpu", "not one of cpu, cuda, mps"),
])
def test_a_bad_switch_is_refused_in_one_line_naming_its_variable(name, value, problem):
    with pytest.raises(UserInputError) as refused:
        TestHooks.from_environment({name: value})
    message = str(refused.value)
    assert message.startswith(f"{name}={value!r} is refused: ") and problem in message and "\n" not in message


def test_hooks_made_by_hand_refuse_bad_values_too():
    with pytest.raises(UserInputError, match="declared_device 'gpu'"):
        TestHooks(declared_device="gpu")
    with pytest.raises(UserInputError, match="model_poison 'sign-flip:x': SCALE must be a number"):
        TestHooks(model_poison="sign-flip:x")
    with pytest.raises(UserInputError, match="engine_net"):
        TestHooks(engine_net="loss=20%")


def test_meshlearn_provider_refuses_a_bad_switch_before_it_asks_the_bootstrap_anything(tmp_path):
    env = {**os.environ, "MESHLEARN_SECRET": "testhooks-secret-0123456789abcdef", testhooks.DEVICE_ENV: "gpu"}
    result = subprocess.run([sys.executable, "-m", "meshlearn", "provider", "--bootstrap", f"127.0.0.1:{free_port()}",
                             "--workdir", str(tmp_path / "p")], capture_output=True, text=True, timeout=120, env=env,
                            check=False)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert f"{testhooks.DEVICE_ENV}='gpu' is refused" in lines[0] and "Traceback" not in result.stderr


def test_no_module_but_the_hooks_module_reads_the_test_switches():
    readers = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if "MESHLEARN_TEST_" in path.read_text())
    assert readers == ["network/provider/testhooks.py"]
    provider = SRC / "network" / "provider"
    assert [path.name for path in provider.glob("*.py") if "os.environ" in path.read_text()] == ["testhooks.py"]
