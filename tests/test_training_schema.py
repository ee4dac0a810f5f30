"""One schema for a training run: the experiment configuration and a network task (its request
and the spec each provider receives) compose ``TrainingSettings``, so a training option is one field.

The test adds a field to a copy of the package's ``training.py`` and finds it, with nothing else
edited, in ``simulate``'s flags, an experiment file, ``request``'s flags, the spec the requester
builds and sends, and the engine configuration a provider runs from that spec."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meshlearn.config import ExperimentConfig
from meshlearn.definitions.base import DEFINITIONS, definition
from meshlearn.errors import ConfigError
from meshlearn.network.task.spec import TaskRequest, TaskSettings, TaskSpec
from meshlearn.plugins import load_user_module
from meshlearn.training import ALGORITHM_SECTIONS, TrainingSettings

SRC = Path(__file__).resolve().parents[1] / "src" / "meshlearn"
FIELD_AFTER = "    dp: DPSettings = Field(DPSettings(), description=DP_HELP)\n"
NEW_FIELD = '    probe_knob: int = Field(7, ge=0, description="a training option this test adds")\n'

PROBE = r"""
import json, sys
from pathlib import Path
from meshlearn.cli.main import build_parser, _resolve
from meshlearn.cli.network import _request_values
from meshlearn.config import make_config, read_config_file
from meshlearn.network.protocol.bootstrapapi import ProviderRecord
from meshlearn.network.requester.service import Requester
from meshlearn.network.task.spec import TaskSpec, validate_request

work = Path(sys.argv[1])
found = {}
parser = build_parser()
found["simulate flag"] = _resolve(parser.parse_args(["simulate", "--probe-knob", "3"])).probe_knob
(work / "run.yaml").write_text("probe_knob: 4\n")
config = make_config(read_config_file(work / "run.yaml"))
found["experiment file"] = config.probe_knob
found["resolved config"] = "probe_knob: 4" in config.to_yaml()
args = parser.parse_args(["request", "--bootstrap", "127.0.0.1:9", "--data-on-providers", "digits",
                          "--probe-knob", "5"])
request = validate_request(_request_values(args))
found["request flag"] = request.probe_knob
requester = Requester(request, "127.0.0.1:9", b"secret", work / "req", say=lambda _: None)
claimed = [ProviderRecord(id=f"p{i}", address=f"127.0.0.1:{7 + i}", ram_gb=8.0, cores=2, device="cpu", location="",
                          status="busy") for i in range(2)]
spec = requester.starter.spec(claimed, None, "127.0.0.1:6", None, work / "shares")
arrived = TaskSpec.parse(json.loads(json.dumps(spec.model_dump(mode="json"))))  # as a provider reads it
found["task spec"] = arrived.probe_knob
found["provider's engine"] = arrived.experiment_config(100, "127.0.0.1", "cpu", 64).probe_knob
print(json.dumps(found))
"""


def test_a_field_added_to_training_settings_reaches_flags_files_requests_and_providers(tmp_path):
    package = tmp_path / "src" / "meshlearn"
    shutil.copytree(SRC, package, ignore=shutil.ignore_patterns("__pycache__"))
    training = package / "training.py"
    source = training.read_text()
    assert source.count(FIELD_AFTER) == 1, "training.py changed: update FIELD_AFTER"
    training.write_text(source.replace(FIELD_AFTER, FIELD_AFTER + NEW_FIELD))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}
    done = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "simulate flag": 3, "experiment file": 4, "resolved config": True, "request flag": 5, "task spec": 5,
        "provider's engine": 5}


def test_the_three_schemas_share_every_training_field():
    for schema in (ExperimentConfig, TaskSettings, TaskRequest, TaskSpec):
        assert set(TrainingSettings.model_fields) <= set(schema.model_fields), schema.__name__
    assert set(ALGORITHM_SECTIONS) == {"dpsgd", "gossip", "leader", "fedavg", "pushsum", "qgdsgdm"}


def test_each_built_in_algorithms_section_is_the_settings_class_its_definition_declares():
    """A built-in algorithm's section is a typed field of ``TrainingSettings`` named as the algorithm;
    its type is the one its registered definition declares, and an algorithm declaring none has none."""
    for name in sorted(set(DEFINITIONS.names()) - set(DEFINITIONS.extensions())):  # a user's: algorithm_settings
        declared = definition(name).settings
        field = TrainingSettings.model_fields.get(name)
        assert (field.annotation if field else None) is declared, name


def test_a_network_task_keeps_its_own_defaults_with_the_training_fields_bounds():
    request = TaskRequest(data="digits")
    assert (request.model, request.batch_size, request.lr, request.algorithm) == ("simplecnn", 16, 0.01, "leader")
    assert ExperimentConfig().model == "mlp"
    for bad in ({"lr": float("inf")}, {"lr": 0}, {"model": "m" * 65}, {"optimizer": "adam:lr"}):
        with pytest.raises(ConfigError):
            TaskRequest(data="digits", **bad)
        with pytest.raises(ConfigError):
            ExperimentConfig(**bad)


def test_a_spec_carries_the_requests_optimizer_to_the_providers_engine():
    """Options that used to be the simulator's alone (optimizer, weight decay, schedule) now travel."""
    spec = TaskSpec(task_id="t1", epochs=1, aggregate_every=1, peer_timeout=5, optimizer="adamw", weight_decay=0.01,
                    lr_schedule="cosine:warmup=2", algorithm="dpsgd", dpsgd={"missing_chunks": "fill-local"},
                    peers=[{"id": "p0", "address": "a:1"}, {"id": "p1", "address": "b:2"}],
                    data={"mode": "local", "dataset": "digits"})
    config = spec.experiment_config(100, "127.0.0.1", "cpu", 64)
    assert (config.optimizer, config.weight_decay, config.lr_schedule, config.dpsgd.missing_chunks) == (
        "adamw", 0.01, spec.lr_schedule, "fill-local")


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "my_algorithm.py"


def _simulate(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshlearn", "simulate", *words], capture_output=True, text=True,
                          cwd=cwd, timeout=120)


def test_a_user_algorithms_setting_is_checked_as_a_flag_and_as_a_file_key(tmp_path):
    """Its flag and its flat key in a file reach the class it declares, which refuses a bad value in
    one line naming the flag or key, before any node starts."""
    flag = _simulate("--models-module", str(EXAMPLE), "--algorithm", "half-step", "--half-step-pull", "2",
                     "--nodes", "4", "--iterations", "1", cwd=tmp_path)
    assert flag.returncode == 2 and flag.stderr.strip().splitlines() == [
        "meshlearn simulate: error: --half-step-pull 2: Input should be less than or equal to 1"], flag.stderr
    (tmp_path / "run.yaml").write_text(f"models_module: {EXAMPLE}\nalgorithm: half-step\nhalf_step_pull: 3\n"
                                       "nodes: 4\niterations: 1\n")
    file = _simulate("--config", "run.yaml", cwd=tmp_path)
    assert file.returncode == 2 and "half_step_pull 3: Input should be less than or equal to 1" in file.stderr
    assert len(file.stderr.strip().splitlines()) == 1, file.stderr


def test_a_user_algorithms_section_in_a_file_is_read_as_a_built_in_ones():
    """``half-step: {pull: 0.4}`` (its name, as ``fedavg:`` is a built-in one's section) reaches the
    class it declares, as its flat key does; a bad value is refused by that class."""
    load_user_module(EXAMPLE)
    for section in ("half-step", "half_step"):
        config = ExperimentConfig(algorithm="half-step", models_module=str(EXAMPLE), **{section: {"pull": 0.4}})
        assert config.settings_of("half-step").pull == 0.4 and config.algorithm_settings == {"pull": 0.4}
    with pytest.raises(ConfigError, match="Input should be less than or equal to 1"):
        ExperimentConfig(algorithm="half-step", models_module=str(EXAMPLE), **{"half-step": {"pull": 3}}) \
            .settings_of("half-step")


def test_settings_of_a_built_in_algorithm_stay_in_its_section():
    config = ExperimentConfig(algorithm="fedavg", fedavg_fraction=0.5)
    assert config.settings_of("fedavg").fraction == 0.5 and config.settings_of("local") is None
    with pytest.raises(ConfigError, match="algorithm_settings is for an algorithm registered by --models-module"):
        ExperimentConfig(algorithm="fedavg", algorithm_settings={"fraction": 0.5})
    with pytest.raises(ConfigError, match="algorithm local declares no settings"):
        ExperimentConfig(algorithm="local", algorithm_settings={"pull": 0.5}).settings_of("local")


def test_a_text_tasks_spec_gives_its_providers_an_engine_configuration():
    """A provider's engine trains on the data taskdata loads, in the task's vocabulary: its
    configuration's dataset field is not that data, so the vocabulary does not travel into it."""
    spec = TaskSpec(task_id="t1", epochs=1, aggregate_every=1, peer_timeout=5, model="gpt-tiny", context=32,
                    vocabulary="chars", algorithm="leader", peers=[{"id": "p0", "address": "a:1"}],
                    data={"mode": "served", "address": "a:2", "files": {}})
    assert spec.experiment_config(100, "127.0.0.1", "cpu", 64).context == 32
